"""output_dir's lease (trainer/runtime/lease.py), in one process: jobs are Lease objects with their
own holder records, on a fake clock; the races are real threads on the real file system."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
from pathlib import Path

import pytest

from trainer.runtime import lease
from trainer.runtime.lease import FILE, Holder, Lease, LeaseHeld

TIMEOUT_S = 120.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def job(name: str, clock: FakeClock, host: str | None = None, pid: int = 4242, job_id: str | None = None,
        pid_ns: str | None = "pid:[1]") -> Holder:
    """A holder record: a job on `host` (by default its own host, named after it)."""
    return Holder(lease_id=f"{name}-lease", host=host or f"{name}-host", pid=pid, pid_ns=pid_ns, job=job_id,
                  started=clock(), renewed=clock())


def leased(folder: Path, me: Holder, clock: FakeClock, alive=lambda pid: True, environ=None) -> Lease:
    return Lease(folder, TIMEOUT_S, me, clock, alive, environ or {})


def on_disk(folder: Path) -> Holder:
    return Holder(**json.loads((folder / FILE).read_text()))


def test_a_second_job_is_refused_in_one_line_naming_the_holder_and_the_way_out(tmp_path, clock):
    a = leased(tmp_path, job("a", clock, job_id="slurm job 11"), clock)
    assert a.acquire() is None
    assert on_disk(tmp_path) == a.me
    clock.now += TIMEOUT_S - 1  # not yet stale
    with pytest.raises(LeaseHeld) as refused:
        leased(tmp_path, job("b", clock, job_id="slurm job 12"), clock).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"output_dir {tmp_path} is in use by another job (host a-host, pid 4242, slurm job 11, "
                              "started 2027-01-15 08:00:00 UTC, renewed 119s ago (lease a-lease))")
    assert "wait for it to end" in message and "another output_dir" in message
    assert f"delete {tmp_path / FILE}" in message and "fault.lease_timeout_s=120s" in message
    assert on_disk(tmp_path) == a.me  # the refused job wrote nothing over it
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # nor beside it


def test_a_lease_not_renewed_for_the_timeout_is_taken_over_with_a_warning(tmp_path, clock):
    a = leased(tmp_path, job("a", clock), clock)
    a.acquire()
    clock.now += TIMEOUT_S + 1
    b = leased(tmp_path, job("b", clock), clock)
    warning = b.acquire()
    assert warning is not None and "took over the lease of host a-host, pid 4242" in warning, warning
    assert "not renewed for 121s (fault.lease_timeout_s=120)" in warning, warning
    assert on_disk(tmp_path) == b.me
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # no take-over marker left
    # The old holder, back, learns it at its next renewal, and writes nothing.
    assert a.renew() == f"another job ({b.me.describe(clock())})"
    assert on_disk(tmp_path) == b.me
    a.release()  # not its lease any more: kept
    assert on_disk(tmp_path) == b.me


def test_renewals_keep_a_lease_held_past_the_timeout(tmp_path, clock):
    a = leased(tmp_path, job("a", clock), clock)
    a.acquire()
    for _ in range(3):
        clock.now += TIMEOUT_S / 2
        assert a.renew() is None
    assert on_disk(tmp_path).renewed == clock.now
    clock.now += TIMEOUT_S - 1  # 2.5 timeouts since it was taken, under one since renewed
    with pytest.raises(LeaseHeld):
        leased(tmp_path, job("b", clock), clock).acquire()


def test_release_removes_the_lease_and_the_next_job_takes_it_plainly(tmp_path, clock):
    a = leased(tmp_path, job("a", clock), clock)
    a.acquire()
    a.release()
    assert list(tmp_path.iterdir()) == []
    assert leased(tmp_path, job("b", clock), clock).acquire() is None


def test_a_lease_deleted_under_its_live_holder_is_written_again_unless_another_job_took_it(tmp_path, clock):
    a = leased(tmp_path, job("a", clock), clock)
    a.acquire()
    (tmp_path / FILE).unlink()  # by hand, believing the holder dead
    clock.now += 1
    assert a.renew() is None
    assert on_disk(tmp_path) == a.me and a.me.renewed == clock.now
    (tmp_path / FILE).unlink()
    b = leased(tmp_path, job("b", clock), clock)
    assert b.acquire() is None  # the next job found the folder free
    assert a.renew() == f"another job ({b.me.describe(clock())})"  # a stops; b keeps it
    assert on_disk(tmp_path) == b.me


def test_a_job_that_wrote_nothing_leaves_no_output_dir(tmp_path, clock):
    """The folder the lease created is removed at the end if nothing else was written in it."""
    for folder, written in ((tmp_path / "empty", False), (tmp_path / "used", True)):
        folder.mkdir()
        held = lease.Renewal(leased(folder, job("a", clock), clock), 60, lambda who: None, created_folder=True)
        held.lease.acquire()
        if written:
            (folder / "config.yaml").write_text("seed: 0\n")
        held.end()
        assert folder.exists() == written
        assert not (folder / FILE).exists()


@pytest.mark.parametrize("holder_job, my_job, taken", [
    pytest.param("slurm job 11", "slurm job 11", True, id="same-slurm-job-requeued"),
    pytest.param("torchrun run r1", "torchrun run r1", True, id="torchrun-restart"),
    pytest.param("slurm job 11", "slurm job 12", False, id="another-slurm-job"),
    pytest.param(None, None, False, id="no-job-on-either"),
])
def test_the_same_job_takes_over_its_own_lease_at_once(tmp_path, clock, holder_job, my_job, taken):
    leased(tmp_path, job("a", clock, job_id=holder_job), clock).acquire()
    clock.now += 1  # fresh
    b = leased(tmp_path, job("b", clock, job_id=my_job), clock)
    if taken:
        assert "held by this same" in (b.acquire() or "")
        assert on_disk(tmp_path) == b.me
    else:
        with pytest.raises(LeaseHeld):
            b.acquire()


def test_the_job_id_comes_from_the_launcher():
    assert lease.job_of({"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "7"}) == "slurm job 7"
    assert lease.job_of({"SLURM_JOB_ID": "7", "SLURM_CLUSTER_NAME": "c"}) == "slurm job 7 on c"
    assert lease.job_of({"TRAINER_JOB_ID": "pj-1", "SLURM_JOB_ID": "7"}) == "job pj-1"
    assert lease.job_of({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun run abc"
    assert lease.job_of({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default names no job
    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "TORCHELASTIC_RUN_ID": "none"}
    assert lease.job_of({**k8s, "PET_RDZV_ENDPOINT": "ft-worker-0:29400"}) == "kubernetes job at ft-worker-0:29400"
    assert lease.job_of({**k8s, "PET_MASTER_ADDR": "ft-node-0-0.ft"}) == "kubernetes job at ft-node-0-0.ft"
    assert lease.job_of({"PET_RDZV_ENDPOINT": "localhost:29400"}) is None  # outside Kubernetes: any host's
    indexed = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3", "HOSTNAME": "score-corpus-3"}
    assert lease.job_of(indexed) == "kubernetes indexed job score-corpus index 3"  # the pod recreated for 3 too
    assert lease.job_of({**indexed, "TRAINER_JOB_ID": "x"}) == "job x"
    assert lease.job_of({}) is None


@pytest.mark.parametrize("same_ns, alive, taken", [
    pytest.param(True, False, True, id="dead-pid-same-namespace"),
    pytest.param(True, True, False, id="live-pid"),
    pytest.param(False, False, False, id="another-pid-namespace"),
])
def test_a_dead_process_of_this_host_leaves_its_lease_at_once(tmp_path, clock, same_ns, alive, taken):
    leased(tmp_path, job("a", clock, host="node1", pid=100), clock).acquire()
    me = job("b", clock, host="node1", pid=200, pid_ns="pid:[1]" if same_ns else "pid:[2]")
    b = leased(tmp_path, me, clock, alive=lambda pid: alive if pid == 100 else True)
    if taken:
        assert "its process 100 on this host is gone" in (b.acquire() or "")
    else:
        with pytest.raises(LeaseHeld):
            b.acquire()


def test_a_restarted_container_of_the_same_pod_takes_it_over(tmp_path, clock):
    leased(tmp_path, job("a", clock, host="job-master-0", pid=7, pid_ns="pid:[1]"), clock).acquire()
    me = job("b", clock, host="job-master-0", pid=7, pid_ns="pid:[2]")
    assert "previous container" in (leased(tmp_path, me, clock, environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
                                    .acquire() or "")


def race(takers: list[Lease]) -> dict[str, str]:
    """Each taker's acquire() on a thread of its own, all released at once: lease id: "won"
    or the refusal."""
    start = threading.Barrier(len(takers))
    outcomes: dict[str, str] = {}

    def take(taker: Lease) -> None:
        start.wait()
        try:
            taker.acquire()
            outcomes[taker.me.lease_id] = "won"
        except LeaseHeld as e:
            outcomes[taker.me.lease_id] = str(e)

    threads = [threading.Thread(target=take, args=(taker,)) for taker in takers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_of_two_takers_of_a_stale_lease_one_wins(tmp_path, clock):
    """Real threads, at once, on the real file system, 20 times: exactly one takes the stale
    lease, every other is refused naming the winner (as the holder, or as taking it over)."""
    for round_ in range(20):
        folder = tmp_path / str(round_)
        folder.mkdir()
        leased(folder, job("dead", clock), clock).acquire()
        clock.now += TIMEOUT_S + 1
        outcomes = race([leased(folder, job(f"t{i}", clock), clock) for i in range(6)])
        winners = [lease_id for lease_id, outcome in outcomes.items() if outcome == "won"]
        assert len(winners) == 1, outcomes
        assert on_disk(folder).lease_id == winners[0]
        refusals = [outcome for outcome in outcomes.values() if outcome != "won"]
        assert all(f"host {winners[0].replace('-lease', '-host')}" in refusal for refusal in refusals), refusals
        assert sorted(p.name for p in folder.iterdir()) == [FILE]


def test_a_taker_that_judged_an_old_lease_stale_backs_off_once_another_took_it(tmp_path, clock):
    """The interleaving threads rarely hit: B judged A's lease stale, then C took it over and
    renewed; B's take-over of A's lease must not replace C's."""
    leased(tmp_path, job("a", clock), clock).acquire()
    clock.now += TIMEOUT_S + 1
    stale = on_disk(tmp_path)
    b = leased(tmp_path, job("b", clock), clock)
    c = leased(tmp_path, job("c", clock), clock)
    assert c.acquire() is not None
    assert b._take_over(stale) is False  # what B's acquire() would do next, having judged it
    assert on_disk(tmp_path) == c.me
    with pytest.raises(LeaseHeld, match="host c-host"):
        b.acquire()


def test_a_take_over_in_progress_refuses_the_other_taker_and_a_dead_takers_marker_is_passed(tmp_path, clock):
    leased(tmp_path, job("a", clock), clock).acquire()
    clock.now += TIMEOUT_S + 1
    b = leased(tmp_path, job("b", clock), clock)
    marker = tmp_path / f".{FILE}.takeover-a-lease.0"
    marker.write_text(json.dumps(dataclasses.asdict(job("c", clock))))  # C is between its marker and the lease
    with pytest.raises(LeaseHeld, match="is being taken over by another job \\(host c-host"):
        b.acquire()
    clock.now += TIMEOUT_S + 1  # C died there: its marker is stale too
    assert b.acquire() is not None
    assert on_disk(tmp_path) == b.me
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]


def test_a_file_that_is_no_lease_is_refused_not_removed(tmp_path, clock):
    (tmp_path / FILE).write_text("not json")
    with pytest.raises(LeaseHeld, match=f"{tmp_path / FILE} is not a lease this trainer wrote"):
        leased(tmp_path, job("b", clock), clock).acquire()
    assert (tmp_path / FILE).read_text() == "not json"


def test_storage_without_hard_links_creates_it_exclusively(tmp_path, clock, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    a = leased(tmp_path, job("a", clock), clock)
    assert a.acquire() is None and on_disk(tmp_path) == a.me
    with pytest.raises(LeaseHeld):
        leased(tmp_path, job("b", clock), clock).acquire()


def test_the_renewal_thread_reports_a_lease_lost(tmp_path, clock):
    a = leased(tmp_path, job("a", clock), clock)
    a.acquire()
    clock.now += TIMEOUT_S + 1
    leased(tmp_path, job("b", clock), clock).acquire()
    lost: list[str] = []
    done = threading.Event()
    renewal = lease.Renewal(a, 0.01, lambda who: (lost.append(who), done.set()))
    renewal.start()
    assert done.wait(30)
    renewal.stop()
    assert lost == [f"another job ({on_disk(tmp_path).describe(clock())})"]
