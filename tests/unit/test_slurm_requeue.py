"""slurm/requeue.py, the verdict and the requeue of both Slurm launchers, without a cluster:
scontrol and sinfo are faked (the real ones answer in tests/system/test_slurm.py)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from trainer import exit_codes
from trainer.exit_codes import Exit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "requeue.py"


def _load():
    spec = importlib.util.spec_from_file_location("requeue", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


requeue = _load()


# --- the verdicts ---------------------------------------------------------------------------


@pytest.mark.parametrize("codes, verdict", [
    ([143], Exit.PREEMPTED),  # a torchrun stopped by TERM forwarded it, and its ranks saved
    ([143, 75], Exit.PREEMPTED),
    ([143, 1], Exit.CRASH),  # stopped beside a crash: the crash is the news
    ([76, 143], Exit.NODE_FAULT),  # --kill-on-bad-exit TERMed the other node's torchrun
    ([77, 2], Exit.USAGE),
    ([137], Exit.CRASH),  # a torchrun SIGKILLed saved nothing
    ([-15], Exit.CRASH),  # a worker killed by a TERM it did not handle
    ([3, 0], Exit.CRASH),
    ([0, 0], Exit.DONE),
    ([], Exit.DONE),
])
def test_a_jobs_verdict_is_its_most_severe_nodes_with_143_as_preempted(codes, verdict):
    assert exit_codes.worst(codes) == verdict
    assert requeue.worst(codes) == verdict


def test_the_scripts_verdicts_are_the_packages():
    """slurm/requeue.py cannot import trainer (on a batch host the package may be in an image
    only) and carries its own table: it must give every code the package's verdict."""
    assert [requeue.of(code) for code in range(-64, 256)] == [exit_codes.of(code) for code in range(-64, 256)]
    some = (-15, -9, 0, 1, 2, 3, 75, 76, 77, 137, 143, 255)
    for n in (1, 2, 3):
        for codes in itertools.combinations(some, n):
            assert requeue.worst(codes) == exit_codes.worst(codes), codes
    assert (requeue.TERMINATED, requeue.NODE_FAULTS_ENV) == (exit_codes.TERMINATED, exit_codes.NODE_FAULTS_ENV)


# --- the node-fault requeue ------------------------------------------------------------------


DISABLED = "Requested operation is presently disabled"


class FakeSlurm:
    """scontrol and sinfo for job 7 on partition `debug`: the job's record, its nodes, and the
    calls made. `refuse` names the commands that fail, as (program, subcommand)."""

    def __init__(self, nodes: int = 1, excluded: str = "(null)", partition: str = "node1 node2 node3",
                 refuse: tuple = ()):
        self.record = f"JobId=7 JobName=trainer Partition=debug NumNodes={nodes} ExcNodeList={excluded} Restarts=0"
        self.partition = partition
        self.refuse = refuse
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *argv: str) -> str:
        self.calls.append(argv)
        if argv[:2] in self.refuse:
            raise requeue.SlurmError(f"{' '.join(argv)}: {DISABLED}")
        if argv[:3] == ("scontrol", "show", "job"):
            return self.record
        if argv[:3] == ("scontrol", "show", "hostnames"):
            return argv[3].replace(",", "\n") + "\n"
        if argv[0] == "sinfo":
            assert argv[1:] == ("-h", "-N", "-p", "debug", "-o", "%N")
            return self.partition.replace(" ", "\n") + "\n"
        return ""

    def made(self) -> list[str]:
        """The calls that change the job: requeue, update ..."""
        return [" ".join(call[1:]) for call in self.calls if call[:2] in (("scontrol", "requeue"),
                                                                           ("scontrol", "update"))]


@pytest.fixture
def job(monkeypatch, tmp_path):
    """(the state folder, the suspects file, a function that installs a FakeSlurm). The process
    keeps its own TERM handler (the requeue ignores TERM)."""
    monkeypatch.setattr(requeue.signal, "signal", lambda *_: None)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TRAINER_MAX_FAULT_REQUEUES", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    state = tmp_path / "state"
    state.mkdir()
    faults = state / "node-faults"
    monkeypatch.setenv(requeue.NODE_FAULTS_ENV, str(faults))

    def slurm(**kwargs) -> FakeSlurm:
        fake = FakeSlurm(**kwargs)
        monkeypatch.setattr(requeue, "_slurm", fake)
        return fake

    return state, faults, slurm


def test_a_node_fault_requeues_then_excludes_the_named_nodes_beside_those_already_excluded(job, capsys):
    state, faults, slurm = job
    fake = slurm(nodes=2, excluded="node4", partition="node1 node2 node3 node4")
    faults.write_text("node1.cluster.example\nnode1\n")
    assert requeue.requeue_without_suspects("7", state, 3, "--max-fault-requeues") is True
    assert fake.made() == ["requeue 7", "update JobId=7 ExcNodeList=node1,node4"]  # in that order
    assert capsys.readouterr().err == "node fault (76): requeueing job 7 without node1\n"
    assert not faults.exists()  # read: the next attempt's ranks start a new one
    assert sorted(p.name for p in state.iterdir()) == ["fault-requeue.0"]


def test_a_node_fault_is_not_requeued_when_the_partition_keeps_too_few_nodes(job, capsys):
    state, faults, slurm = job
    fake = slurm(nodes=2, partition="node1 node2")
    faults.write_text("node2\n")
    assert requeue.requeue_without_suspects("7", state, 3, "TRAINER_MAX_FAULT_REQUEUES", "slurm/ddp.sh: ") is False
    assert fake.made() == []
    assert capsys.readouterr().err == ("slurm/ddp.sh: node fault (76): without node2, partition debug has 1 node(s) "
                                       "for a job of 2: not requeueing\n")


def test_the_budget_counts_the_earlier_attempts_node_fault_requeues_and_one_caller_per_attempt_decides(
        job, monkeypatch, capsys):
    """Attempts 0 and 2 were requeued for node faults, attempt 1 by its time limit: attempt 3
    has used 2. Of the callers in one attempt (submitit's ranks), the first decides."""
    state, _, slurm = job
    (state / "fault-requeue.0").touch()
    (state / "fault-requeue.2").touch()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    fake = slurm()
    assert requeue.requeue_without_suspects("7", state, 2, "--max-fault-requeues") is False
    assert capsys.readouterr().err == ("node fault (76) after 2 requeue(s) for node faults (--max-fault-requeues=2): "
                                       "not requeueing\n")
    assert fake.calls == []
    (state / "fault-requeue.3").unlink()
    assert requeue.requeue_without_suspects("7", state, 3, "--max-fault-requeues") is True
    assert fake.made() == ["requeue 7"]
    assert requeue.requeue_without_suspects("7", state, 3, "--max-fault-requeues") is True  # another rank
    assert fake.made() == ["requeue 7"]
    assert capsys.readouterr().err == "node fault (76): requeueing job 7 without (no node named)\n"


def test_a_refused_exclusion_leaves_the_node_fault_requeue_standing(job, capsys):
    """Slurm accepted the requeue, then refused ExcNodeList: the job is requeued all the same,
    with a warning, not failed by the exception."""
    state, faults, slurm = job
    fake = slurm(refuse=(("scontrol", "update"),))
    faults.write_text("node1.cluster.example\n")
    assert requeue.requeue_without_suspects("7", state, 3, "--max-fault-requeues") is True
    assert fake.made() == ["requeue 7", "update JobId=7 ExcNodeList=node1"]
    refused = "scontrol update JobId=7 ExcNodeList=node1"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"warning: requeued, but Slurm refused ExcNodeList=node1: {refused}: {DISABLED}")


@pytest.mark.parametrize("refused, says", [
    (("scontrol", "requeue"), f"node fault (76): not requeued: scontrol requeue 7: {DISABLED}"),
    (("scontrol", "show"), f"node fault (76): not requeueing: scontrol show job -o 7: {DISABLED}"),
])
def test_a_failing_slurm_command_is_one_line_and_no_requeue(job, capsys, refused, says):
    state, faults, slurm = job
    fake = slurm(refuse=(refused,))
    faults.write_text("node1\n")
    assert requeue.requeue_without_suspects("7", state, 3, "--max-fault-requeues") is False
    assert capsys.readouterr().err.splitlines()[-1] == says
    assert "update" not in " ".join(fake.made())


# --- slurm/ddp.sh's end --------------------------------------------------------------------


REQUEUED = "slurm/ddp.sh: node fault (76): requeueing job 7 without node2"
NO_BUDGET = ("slurm/ddp.sh: node fault (76) after 0 requeue(s) for node faults (TRAINER_MAX_FAULT_REQUEUES=0): "
             "not requeueing")


@pytest.mark.parametrize("recorded, srun, time_limit, env, code, says, requeued", [
    ({"node1": "2", "node2": "143"}, 143, True, {}, 2, "slurm/ddp.sh: exit 2: not requeueing", []),
    ({"node1": "77"}, 77, False, {}, 77, "slurm/ddp.sh: exit 77: not requeueing", []),
    ({"node1": "1", "node2": "143"}, 1, False, {}, 1, None, []),
    ({"node1": "143", "node2": "143"}, 143, False, {}, 75, None, []),  # scancel or a preemption: Slurm's call
    ({"node1": "143", "node2": "143"}, 143, True, {}, 0, "slurm/ddp.sh: checkpoint saved; requeueing job 7",
     ["requeue 7"]),
    ({}, 1, False, {}, 1, None, []),  # no node recorded a code: srun's
    ({"node1": "76", "node2": "143"}, 143, False, {}, 0, REQUEUED, ["requeue 7", "update JobId=7 ExcNodeList=node2"]),
    ({"node1": "76"}, 76, False, {"TRAINER_MAX_FAULT_REQUEUES": "0"}, 76, NO_BUDGET, []),
    ({"node1": "\n"}, 0, False, {}, 0, None, []),  # a record cut short: nothing to say
    ({"node1": "oops"}, 0, False, {}, 1, None, []),
], ids=["usage", "no-progress", "crash", "terminated", "time-limit", "srun", "node-fault", "no-budget", "empty",
        "torn"])
def test_ddp_sh_ends_with_its_nodes_verdict_and_requeues_what_may_be_retried(
        job, monkeypatch, capsys, recorded, srun, time_limit, env, code, says, requeued):
    """The verdict from the codes each node's relay recorded, then the requeue: the job's folder
    goes, unless it holds a preempted job's or a requeued one's budget."""
    state, faults, slurm = job
    fake = slurm()
    for node, text in recorded.items():
        (state / f"exit.{node}").write_text(text)
    faults.write_text("node2\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["end", "--state", str(state), "--srun-status", str(srun), *(["--time-limit"] if time_limit else [])]
    assert requeue.main(argv) == code
    assert fake.made() == requeued
    assert capsys.readouterr().err.splitlines() == ([says] if says else [])
    assert state.exists() == (code == 75 or bool(requeued))


def test_ddp_sh_refuses_a_budget_that_is_not_a_number_in_its_first_seconds(job, monkeypatch, capsys):
    monkeypatch.setenv("TRAINER_MAX_FAULT_REQUEUES", "three")
    assert requeue.main(["check"]) == Exit.USAGE
    assert capsys.readouterr().err == ("slurm/ddp.sh: error: TRAINER_MAX_FAULT_REQUEUES=three is not a number of "
                                       "requeues (0 or more)\n")
    monkeypatch.setenv("TRAINER_MAX_FAULT_REQUEUES", "0")
    assert requeue.main(["check"]) == Exit.DONE
