"""Faults across nodes: each "node" is a network namespace running its own torchrun.

- a worker SIGKILLed mid-run (rank 0, which hosts the store): torchrun restarts everyone,
  training resumes from the last valid checkpoint, and the final weights are bitwise the
  uninterrupted run's;
- elastic membership under `--nnodes=1:2`: a node lost for good leaves the job going on with
  the node left, at world size 1, and a node that joins is taken in at the next restart, on
  the same global batches throughout;
- SIGTERM to one node (a pod eviction, a Slurm preemption): every rank saves at the next
  step boundary and exits 75; the relaunch is bitwise exact too;
- a node frozen (SIGSTOP) in a checkpoint save: the survivors name
  the phase and the silent peers with their stacks, and exit within the timeout, the last
  complete checkpoint intact;
- a node that never arrives: the rendezvous fails in bounded time and says how many came;
- an FSDP job across the two nodes, its rank 0 SIGKILLed: restarted, resharded, bitwise.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from support import multinode
from support.netns import Network
from support.outputs import complete_steps, read_summary
from support.processes import signals_in, wait_for
from support.runs import tiny_overrides, train
from support.weights import EXACT_STEPS, compare_weights, weights

from trainer.exit_codes import NODE_FAULTS_ENV, Exit

STEPS = EXACT_STEPS  # the node-loss run is held to single_process_weights
OPTIONS = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 5, "checkpoint.keep": 2,
           "train.log_every": 5, "data.num_workers": 1}  # the default: a fault must end the loader's worker too
TWO_NODES = {"node0": [], "node1": []}


def run_to_end(net: Network, logs, overrides, timeout: float = 240, **kwargs) -> list[int | None]:
    procs = multinode.launch(net, logs, overrides, **kwargs)
    return net.wait(list(procs.values()), timeout)


def logs_of(logs, tail: int | None = 5000) -> str:
    """Every host's log; the last `tail` characters of each, for assertion messages."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail if tail else 0:]}" for p in sorted(logs.glob("*.log")))


def on_two_nodes(overrides: list[str], workdir) -> None:
    """A reference_run launcher: node0 and node1, one torchrun each, to the end."""
    with Network(TWO_NODES) as net:
        codes = run_to_end(net, workdir / "logs", overrides)
    assert codes == [0, 0], logs_of(workdir / "logs")


@pytest.fixture(scope="module")
def uninterrupted(reference_run, dropout_model):
    out = reference_run(on_two_nodes, dropout_model, **OPTIONS).run
    assert read_summary(out)["hosts"] == ["node0", "node1"]
    return out


@pytest.mark.parametrize("kill", ["0:19"])
def test_elastic_restart_after_sigkill_is_bitwise_exact(uninterrupted, dropout_model, reviews, tmp_path, kill):
    """`torchrun --max-restarts`: one SIGKILLed worker, every worker restarted, one launch."""
    out = tmp_path / "run"
    overrides = tiny_overrides(dropout_model, reviews, out, **OPTIONS)
    with Network(TWO_NODES) as net:
        codes = run_to_end(net, tmp_path / "logs", overrides, torchrun_args=("--max-restarts=2",),
                           env={"TRAINER_FAULT_SIGKILL": kill})
    assert codes == [0, 0], logs_of(tmp_path / "logs")
    logs = logs_of(tmp_path / "logs", tail=None)
    killed_at = int(kill.split(":")[1])
    resumed_from = (killed_at - 1) // 5 * 5  # the last checkpoint before the kill
    assert "failed (exitcode: -9)" in logs  # torchrun saw the SIGKILL, and restarted the workers
    assert f"resumed from {out / 'checkpoints' / f'step-{resumed_from}'}" in logs
    assert read_summary(out)["resumed_from_step"] == resumed_from
    assert not compare_weights(uninterrupted, out, STEPS).differing


def test_an_fsdp_job_across_two_nodes_restarts_after_a_sigkill_bitwise(dropout_model, reviews, tmp_path):
    """FSDP2's all-gathers and reduce-scatters cross the nodes' link inside every forward and
    backward. Rank 0 (which hosts the store) is SIGKILLed at step 13; torchrun restarts both
    nodes' workers, which reshard the DCP checkpoint of step 10 and end bitwise equal to an
    uninterrupted 2-rank run on one host."""
    options = {**OPTIONS, "train.strategy": "fsdp", "train.max_steps": 20, "ddp.sparse_embedding_grad": False}
    reference = tmp_path / "reference"
    train(tiny_overrides(dropout_model, reviews, reference, **options))
    out = tmp_path / "run"
    with Network(TWO_NODES) as net:
        codes = run_to_end(net, tmp_path / "logs", tiny_overrides(dropout_model, reviews, out, **options),
                           torchrun_args=("--max-restarts=1",), env={"TRAINER_FAULT_SIGKILL": "0:13"})
    logs = logs_of(tmp_path / "logs", tail=None)
    assert codes == [0, 0], logs_of(tmp_path / "logs")
    assert "failed (exitcode: -9)" in logs and f"resumed from {out / 'checkpoints' / 'step-10'}" in logs
    assert read_summary(out)["hosts"] == ["node0", "node1"]
    assert (out / "checkpoints" / "step-20" / "sharded" / "__1_0.distcp").is_file()  # node1 wrote its shard
    assert not compare_weights(reference, out, 20).differing


def children(net: Network, host: str, parent: int) -> list[int]:
    """The processes on `host` whose parent is `parent` (torchrun's: its ranks; not their own
    DataLoader workers, nor a process that ended since the listing)."""
    found = []
    for pid in net.pids(host):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # the field after the name is the state, then ppid
            found.append(int(pid))
    return found


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits for a stopped process (it acts once the process continues)."""
    return signal.SIGTERM in signals_in(pid, "SigPnd", "ShdPnd")


def resumed_at(log: str, step: int) -> float:
    """When the log's `resumed from .../step-STEP` line was written (Unix time)."""
    stamp = re.search(rf"^(\S+ \S+) \[rank 0\] INFO trainer.checkpoint.resume: resumed from \S+/step-{step} ", log,
                      re.MULTILINE)
    assert stamp, log[-5000:]
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_node_lost_for_good_then_a_node_joining_resize_the_job(single_process_weights, tiny_model, reviews,
                                                                  tmp_path):
    """`torchrun --nnodes=1:2 --max-restarts=1` on two nodes, train.global_batch=16.

    Lost: node1's worker stops itself at step 23 (a test hook), then every process of
    node1 is SIGKILLed: a reclaimed spot node says no goodbye. node0's worker fails in that
    step's all-reduce; its torchrun forms a new rendezvous alone once node1's heartbeat is
    overdue, and the restarted worker resumes step 20 at world size 1 (1 x 8 x 2).
    Joined: node0's worker stops itself at step 33; node1 starts again, node0's torchrun
    sees a node waiting and stops its worker (SIGTERM: it saves at the next step boundary
    and exits 75), and both resume that checkpoint at world size 2. Each resume verifies the data position; the
    weights end within 1e-5 of the uninterrupted single process, like any world size."""
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, reviews, out, **{**OPTIONS, "train.global_batch": 16})
    # A lost node is dropped after 5 s without a heartbeat (1 s apart), not torchrun's 15 s;
    # late nodes get a last call of 1 s. (Heartbeats may come up to 2 intervals apart: with 2
    # attempts a live node0 looked dead to the joining node1, which then trained alone.)
    elastic = ("--max-restarts=1", "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5")
    logs = tmp_path / "logs"
    launch = functools.partial(multinode.launch, overrides=overrides, nnodes="1:2", torchrun_args=elastic)
    with Network(TWO_NODES) as net:
        # node0's worker stops itself at step 33 once torchrun has restarted it (alone)
        node0 = launch(net, logs, hosts=["node0"], env={"TRAINER_FAULT_SIGSTOP": "0@1:step:33"})["node0"]
        node1 = launch(net, logs, hosts=["node1"], env={"TRAINER_FAULT_SIGSTOP": "1:step:23"})["node1"]
        wait_for(lambda: multinode.frozen(net, "node1") == 1, 180, "node1's worker to stop at step 23",
                 {"node0": node0, "node1": node1})
        lost = time.time()
        for pid in net.pids("node1"):
            os.kill(int(pid), signal.SIGKILL)
        wait_for(lambda: multinode.frozen(net, "node0") == 1, 180, "node0's worker, alone, to stop at step 33",
                 {"node0": node0})
        (worker,) = psutil.Process(node0.pid).children()
        resumed_alone = resumed_at((logs / "node0.log").read_text(), 20) - lost

        node1 = launch(net, logs / "joined", hosts=["node1"])["node1"]
        wait_for(lambda: sigterm_pending(worker.pid), 120, "node0's torchrun to stop its worker for node1",
                 {"node0": node0, "node1": node1})
        worker.resume()
        codes = net.wait([node0, node1], timeout=180)
    every_log = logs_of(logs, tail=None) + logs_of(logs / "joined", tail=None)
    assert codes == [0, 0], logs_of(logs) + logs_of(logs / "joined")
    assert resumed_alone < 60, f"node0 resumed {resumed_alone:.1f}s after node1 was lost"
    # Stopped for node1, node0's worker saved at the step boundary after its SIGTERM.
    saved = int(re.search(r"preempted by SIGTERM: saved the checkpoint of step (\d+)", every_log).group(1))
    assert 33 <= saved < STEPS
    summary = read_summary(out)
    assert (summary["world_size"], summary["hosts"], summary["resumed_from_step"]) == (2, ["node0", "node1"], saved)
    assert "resumed at world size 1 from a checkpoint of world size 2" in every_log
    assert "resumed at world size 2 from a checkpoint of world size 1" in every_log
    assert "data position verified: epoch 0, 320 samples consumed" in every_log
    assert f"data position verified: epoch 0, {saved * 16} samples consumed" in every_log
    assert compare_weights(single_process_weights, weights(out, STEPS)).max_abs <= 1e-5


def test_sigterm_on_one_node_saves_everywhere_and_resumes_exactly(uninterrupted, dropout_model, reviews, tmp_path):
    """The preempted node's torchrun forwards SIGTERM to its workers, which only set a flag.
    All ranks agree on it at a step boundary, save together, and exit 75."""
    out = tmp_path / "run"
    overrides = tiny_overrides(dropout_model, reviews, out, **OPTIONS)
    with Network(TWO_NODES) as net:
        procs = multinode.launch(net, tmp_path / "logs", overrides)
        wait_for(lambda: 10 in complete_steps(out), 120, "checkpoint step-10", procs)
        # Freeze the workers, so that the signal lands mid-run however fast this machine is,
        # signal node1's torchrun (it forwards SIGTERM to its workers), and thaw them.
        launchers = {str(p.pid) for p in procs.values()}
        workers = [pid for host in TWO_NODES for pid in net.pids(host) if pid not in launchers]
        for pid in workers:
            os.kill(int(pid), signal.SIGSTOP)
        # A worker not yet stopped (not scheduled since: a loaded machine) would take the
        # SIGTERM first, lowest signal first, and stop with none pending.
        wait_for(lambda: sum(multinode.frozen(net, host) for host in TWO_NODES) == len(workers), 30,
                 "the workers to stop", procs)
        node1_ranks = children(net, "node1", procs["node1"].pid)
        assert node1_ranks, net.pids("node1")
        signalled = time.monotonic()
        procs["node1"].send_signal(signal.SIGTERM)  # nsenter, unshare and sh exec: this is torchrun
        # torchrun forwards it to node1's workers: thawed before it arrives, a worker could
        # finish the run first.
        wait_for(lambda: all(sigterm_pending(pid) for pid in node1_ranks), 30,
                 "torchrun to forward SIGTERM to node1's workers", procs)
        for pid in workers:
            os.kill(int(pid), signal.SIGCONT)
        codes = net.wait(list(procs.values()), timeout=60)
        elapsed = time.monotonic() - signalled
    logs = logs_of(tmp_path / "logs", tail=None)
    assert None not in codes, logs_of(tmp_path / "logs")
    assert elapsed < 30, f"took {elapsed:.1f}s to save and exit"  # torchrun SIGKILLs after 30 s
    saved = re.findall(r"preempted by (.+?): saved the checkpoint of step (\d+); exiting with 75", logs)
    # Each rank says so, at the same step: the signalled one names the signal.
    assert sorted(by for by, _ in saved) == ["SIGTERM", "a preemption signal on another rank"], logs
    assert {step for _, step in saved} == {str(complete_steps(out)[-1])}
    step = int(saved[0][1])
    assert 10 <= step < STEPS and not (out / "summary.json").exists()
    assert "exitcode  : 75" in logs  # what torchrun on the surviving node saw its worker return

    with Network(TWO_NODES) as net:
        codes = run_to_end(net, tmp_path / "logs-resumed", overrides)
    assert codes == [0, 0], logs_of(tmp_path / "logs-resumed")
    assert read_summary(out)["resumed_from_step"] == step
    assert not compare_weights(uninterrupted, out, STEPS).differing


# The watchdog watches every phase that enters a collective alike; a checkpoint save is the
# one that leaves a torn folder behind.
@pytest.mark.parametrize("phase, name", [("save", "checkpoint save")])
def test_a_frozen_node_is_reported_by_phase_and_the_job_fails_within_the_timeout(dropout_model, reviews, tmp_path,
                                                                                 phase, name):
    """Both ranks of node1 freeze (SIGSTOP) as they enter a phase outside the train step: the
    log all-reduce, or a checkpoint save (a test hook makes them stop exactly there, not a
    timer). node0's two ranks wait in that phase's collective; before the timeout each names
    the phase and both silent peers and dumps its stacks, and they exit within the timeout
    plus a margin."""
    out = tmp_path / "run"
    timeout_s = 10
    overrides = tiny_overrides(dropout_model, reviews, out, **{
        **OPTIONS, "train.max_steps": 100000, "checkpoint.every": 10, "dist.timeout_s": timeout_s,
        "fault.slow_step_min_s": 2, "fault.heartbeat_s": 1})
    suspects = tmp_path / "node-faults"
    with Network(TWO_NODES) as net:
        procs = {**multinode.launch(net, tmp_path / "logs", overrides, nproc=2, hosts=["node0"],
                                    env={NODE_FAULTS_ENV: str(suspects)}),
                 **multinode.launch(net, tmp_path / "logs", overrides, nproc=2, hosts=["node1"],
                                    env={"TRAINER_FAULT_SIGSTOP": f"*:{phase}:20"})}
        wait_for(lambda: multinode.frozen(net, "node1") == 2, 180, f"node1 to freeze in {phase} at step 20", procs)
        frozen = time.monotonic()
        (code,) = net.wait([procs["node0"]], timeout=timeout_s + 60)
        elapsed = time.monotonic() - frozen
    node0 = (tmp_path / "logs" / "node0.log").read_text()
    # A node fault (retry, elsewhere), naming the node to leave out: each of node0's ranks names node1.
    assert code == Exit.NODE_FAULT, node0[-5000:]
    assert suspects.read_text().split() in (["node1"], ["node1", "node1"]), node0[-5000:]
    assert elapsed < timeout_s + 20, f"node0 took {elapsed:.1f}s to give up"
    # The watchdog of each rank of node0, before the collective timeout: the phase, both silent peers.
    reports = re.findall(rf"rank (\d) on node0: stalled in {name} at step 20: has run ([\d.]+)s .*the job may be hung",
                         node0)
    assert {rank for rank, _ in reports} == {"0", "1"}, node0[-5000:]
    assert all(float(seconds) < timeout_s for _, seconds in reports), reports
    assert set(re.findall(r"rank (\d) on node1: NOT RESPONDING", node0)) == {"2", "3"}, node0[-5000:]
    assert "Timed out" in node0  # the collective that stalled, as gloo reports it
    # Every local rank of node0 dumped its stacks, into the log and into output_dir/stacks.
    dumps = {p.name: p.read_text() for p in (out / "stacks").glob("rank-*.txt")}
    on_node0 = [name for name, text in dumps.items() if " on node0: " in text]
    assert len(on_node0) == 2, dumps.keys()
    assert all("File " in dumps[name] and "Thread " in dumps[name] for name in on_node0)

    # Step 20's save never completed; what is on disk is complete, and a relaunch resumes it
    # (a torn checkpoint is skipped: tests/e2e/test_checkpoint_integrity.py).
    assert complete_steps(out)[-1] == 10


def test_a_node_that_never_arrives_fails_the_rendezvous_in_bounded_time(tiny_model, reviews, tmp_path):
    """Only node0 starts. Its torchrun gives up after join_timeout and says who came."""
    join_timeout = 8
    with Network(TWO_NODES) as net:
        procs = multinode.launch(net, tmp_path / "logs", tiny_overrides(tiny_model, reviews, tmp_path / "run"),
                                 hosts=["node0"], torchrun_args=(f"--rdzv-conf=join_timeout={join_timeout}",))
        started = time.monotonic()
        (code,) = net.wait([procs["node0"]], timeout=120)
        elapsed = time.monotonic() - started
    log = (tmp_path / "logs" / "node0.log").read_text()
    assert code == 1, log[-3000:]
    assert elapsed < join_timeout + 15, f"gave up after {elapsed:.1f}s"
    assert (f"RendezvousTimeoutError: rendezvous at node0:{multinode.RDZV_PORT} timed out after "
            f"{join_timeout}s: 1 of 2 nodes arrived") in log, log[-3000:]
    assert not (tmp_path / "run").exists()  # no worker ever started
