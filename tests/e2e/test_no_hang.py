"""No silent hang: whatever fails, on whichever rank, every process exits in bounded time.

With the default loader workers on: they ignore preemption signals, and once made an
interpreter exit wait forever for them. Faults are injected at exact points
(TRAINER_FAULT_RAISE), never by timing. A peer's collective timeout, with workers on too, is
tests/system/test_multinode_faults.py's frozen node.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from support.fake_hub import FakeHub
from support.processes import kill_tree, signals_in, wait_for
from support.runs import BASE_ENV, launch, run, tiny_overrides, train, trainer_command
from support.users import UID, as_user

from trainer.exit_codes import Exit

WORKERS = {"data.num_workers": 1, "train.max_steps": 30}  # 1 is the default: on purpose


def failed_at(output: str, pattern: str) -> float:
    """Unix time of the first log line matching `pattern` (the logs' asctime, local time)."""
    match = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", output, re.M)
    assert match, output[-4000:]
    return datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.parametrize("nproc, fault", [
    pytest.param(None, "0:3", id="one-process"),
    pytest.param(2, "1:3", id="one-rank-of-two"),
    pytest.param(2, "*:3", id="every-rank"),
])
def test_an_exception_mid_run_ends_every_process_in_seconds(tiny_model, reviews, tmp_path, nproc, fault):
    result = launch(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **WORKERS), nproc),
                    env={"TRAINER_FAULT_RAISE": fault}, timeout=180)
    exited = time.time()
    assert result.returncode != 0
    assert "InjectedFault: TRAINER_FAULT_RAISE: injected at step 3" in result.output, result.output[-4000:]
    # From the first rank's failure report to the last process gone (torchrun included).
    assert exited - failed_at(result.output, "step 3 failed: InjectedFault") < 30, result.output[-4000:]


FORK_PROBE = """
import json, os, threading
def _record():  # in the parent, as os.fork() begins
    with open(os.environ["FORK_PROBE_FILE"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "threads": [t.name for t in threading.enumerate()],
                            "tasks": len(os.listdir("/proc/self/task"))}) + "\\n")
os.register_at_fork(before=_record)
"""
"""A sitecustomize that records, at each os.fork(), the threads the forking process runs."""


def test_loader_workers_come_from_a_lone_server_not_a_fork_of_their_rank(tiny_model, reviews, tmp_path):
    """A fork of a rank copies the locks its other threads hold at that instant (gloo's, torch's
    pools', wandb's), held for good in the child: a loader worker that needs one never delivers
    its first batch, and two-node jobs hung at their first step so. So each rank's workers come
    from multiprocessing's forkserver, a program of its own that runs one thread when it forks:
    a sitecustomize records the threads at every fork. The rank itself forks nothing (its data
    is too small for a tokenizing pool).

    The server and its worker hold none of their rank's sockets: a SIGKILLed rank's peers see
    its connections close at once. And both block SIGTERM, which torchrun sends to the rank's
    whole process group: a dead server would take the worker with it, failing the rank before
    it saves. Both ranks freeze as step 4's save begins, after two evals (which start no
    worker: data._eval_loader); wandb runs on rank 0, offline, as by default."""
    probe, forks = tmp_path / "probe", tmp_path / "forks.jsonl"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(FORK_PROBE)
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **WORKERS, **{
        "checkpoint.every": 2, "train.eval_every": 2, "wandb.mode": "offline"})
    torchrun = subprocess.Popen(trainer_command(overrides, nproc=2), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**BASE_ENV, "TRAINER_FAULT_SIGSTOP": "*:save:4", "PYTHONPATH": str(probe),
                                     "FORK_PROBE_FILE": str(forks)})
    try:
        def frozen_ranks() -> list[psutil.Process] | None:
            ranks = psutil.Process(torchrun.pid).children()
            stopped = [rank for rank in ranks if rank.status() == psutil.STATUS_STOPPED]
            return stopped if len(stopped) == 2 else None

        ranks = wait_for(frozen_ranks, 180, "both ranks frozen at step 4's save", {"torchrun": torchrun})
        records = [json.loads(line) for line in forks.read_text().splitlines()]
        for rank in ranks:
            assert rank.net_connections("inet"), rank  # what the check looks for is there
            assert signal.SIGTERM not in signals_in(rank.pid, "SigBlk"), rank  # the rank takes it: it saves
            servers = [child for child in rank.children() if "multiprocessing.forkserver" in " ".join(child.cmdline())]
            assert len(servers) == 1, (rank, rank.children())
            workers = servers[0].children()
            assert [worker.name() for worker in workers] == ["pt_data_worker"], (rank, workers)
            for process in (servers[0], workers[0]):
                assert process.net_connections("inet") == [], (rank, process)
                assert signal.SIGTERM in signals_in(process.pid, "SigBlk"), (rank, process)
            assert [record for record in records if record["pid"] == rank.pid] == [], (rank, records)
            assert [{key: record[key] for key in ("threads", "tasks")} for record in records
                    if record["pid"] == servers[0].pid] == [{"threads": ["MainThread"], "tasks": 1}], records
    finally:
        kill_tree(torchrun)


def test_rank_zero_unable_to_write_output_dir_stops_every_rank_with_its_error(tiny_model, reviews, tmp_path):
    """Run as the image's user: root would ignore the read-only folder. Rank 0 creates
    output_dir; rank 1 must not wait for it at the next collective (30 minutes, by default)."""
    public = Path(tempfile.mkdtemp(prefix="unprivileged-"))  # pytest's tmp folders are root's alone
    try:
        public.chmod(0o755)
        shutil.copytree(tiny_model, public / "model")
        shutil.copytree(reviews, public / "data")
        subprocess.run(["chmod", "-R", "a+rX", public], check=True)  # copies keep pytest's 0700
        home = public / "home"
        home.mkdir()
        os.chown(home, UID, UID)
        (public / "read-only").mkdir()  # root's, 0755: the user cannot create anything in it
        output_dir = public / "read-only" / "run"
        overrides = tiny_overrides(public / "model", public / "data", output_dir)
        started = time.monotonic()
        result = run(as_user(trainer_command(overrides, nproc=2), tmp_path / "python"),
                     env={"HOME": str(home)}, timeout=180)
        elapsed = time.monotonic() - started
    finally:
        shutil.rmtree(public, ignore_errors=True)
    assert result.returncode == Exit.USAGE, result.output[-4000:]
    # Each rank raises rank 0's error, one line; torchrun may end the other rank before it prints.
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) in (1, 2) and len(set(errors)) == 1, result.output[-4000:]
    # Whose folder refused, and the usual cause on a cluster: a volume whose CSI driver ignores fsGroup.
    assert errors[0].startswith(f"error: output_dir {output_dir}: Permission denied: {output_dir.parent} belongs to "
                                f"uid 0, gid 0 (mode 755) and this process runs as uid {UID}, gid {UID}."), errors
    assert "fsGroup" in errors[0], errors
    assert not re.search(r"\[rank\d\]: Traceback", result.output)  # torchrun's own report aside
    assert elapsed < 60, f"took {elapsed:.1f}s"  # launch, imports and the failure: no waiting


def test_a_hub_model_is_downloaded_once_per_node(tiny_model, reviews, tmp_path):
    """Two ranks of one node share one HF cache (as on a shared PVC): local rank 0 fetches
    the model while the other waits, then reads the cache. The hub is a loopback server that
    counts every download of a file's bytes, each slowed to a second, as a real network is."""
    repo = "lab/tiny-bert"
    with FakeHub({repo: tiny_model}, delay_s=1.0) as hub:
        overrides = tiny_overrides(repo, reviews, tmp_path / "run")
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home")}
        train(overrides, nproc=2, env=env)
    assert hub.downloads[f"{repo}/model.safetensors"] == 1, hub.downloads
    assert hub.downloads[f"{repo}/config.json"] == 1, hub.downloads
    # One process at a time: the second rank asks only once the first has everything.
    (first, second) = hub.sessions()
    assert first[1] <= second[0], (first, second)
