"""sweep.preload (trainer/sweep/preload.py): a sweep's one-rank runs forked from a zygote that
imported the training stack once. A forked run starts as a fresh interpreter would, but for
the modules already imported (here: its signals, mask, threads, random state, stdin and
environment, against `python -m` of the same probe); the zygote refuses a run it cannot
start that way; a signal to the whole process group leaves it alive to report its runs'
exit statuses; and should it die, its runs are killed and reported so. That a forked trial
trains the same bits as the same run started alone is tests/e2e/test_sweep.py's
test_a_trial_run_alone_trains_what_it_trained_in_the_sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.runs import BASE_ENV, TESTS

from trainer.sweep import preload

PROBE = [sys.executable, "-m", "support.fresh_state"]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A zygote started as the sweep starts it, with its first run (here in tests/, where the
    probe is importable), in this process's environment then (ENV), which its runs are given."""
    here = os.getcwd()
    os.chdir(TESTS)
    try:
        started = preload.Preloaded()
        ENV.update(os.environ)
        assert probe(started, tmp_path_factory.mktemp("zygote") / "first.log").wait(timeout=120) == 0
    finally:
        os.chdir(here)
    yield started
    started.close()
    assert started.process.wait(timeout=60) == 0


ENV: dict[str, str] = {}


def probe(zygote: preload.Preloaded, log: Path, *args: str, env: dict[str, str] | None = None) -> preload.Run:
    with log.open("a") as out:
        return zygote.start([*PROBE, *args], ENV if env is None else env, out)


def state(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_run_starts_as_a_fresh_interpreter_would(zygote, tmp_path):
    fresh = subprocess.run([*PROBE, "3"], cwd=TESTS, env=BASE_ENV, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
    assert fresh.returncode == 3, fresh.stderr
    started_fresh = json.loads(fresh.stdout.splitlines()[0])

    runs = [probe(zygote, tmp_path / f"{n}.log", "3", env={**ENV, "CUDA_VISIBLE_DEVICES": str(n)})
            for n in range(2)]
    assert [run.wait(timeout=60) for run in runs] == [3, 3]
    forked = [state(tmp_path / f"{n}.log") for n in range(2)]
    for n, started in enumerate(forked):
        assert started["torch_imported"] and not started_fresh["torch_imported"]  # preloaded, and it is a fork
        assert not started["cuda_initialized"]
        for key in ("argv", "threads", "signals", "blocked", "cwd", "stdin"):
            assert started[key] == started_fresh[key], key
        assert started["cuda_visible_devices"] == str(n)  # its own environment
    for generator in ("random", "numpy_random"):  # seeded afresh, each
        assert forked[0][generator] != forked[1][generator], generator


def test_the_zygote_refuses_what_it_cannot_start_as_it_would_start_afresh(zygote, tmp_path):
    with pytest.raises(preload.Refused, match="differs from the sweep's at its start in HF_HOME, TRAINER_X"):
        probe(zygote, tmp_path / "env.log", env={**ENV, "HF_HOME": "/elsewhere", "TRAINER_X": "1"})
    with (tmp_path / "torchrun.log").open("a") as out, pytest.raises(preload.Refused, match="not a `python -m MODULE`"):
        zygote.start(["torchrun", "-m", "trainer"], ENV, out)
    assert not preload.forkable([sys.executable, "-m", "trainer.cli.torchrun", "--standalone", "-m", "trainer"])
    assert preload.forkable([sys.executable, "-m", "trainer", "train", "-c", "x.yaml"])
    assert probe(zygote, tmp_path / "after.log").wait(timeout=60) == 0  # and serves on


def test_a_signal_to_the_process_group_leaves_the_zygote_to_report_its_runs(zygote, tmp_path):
    """As a scheduler's SIGTERM reaches every process of the sweep: the run answers it (a
    trainer saves, then exits 75), and the zygote, which blocks it, lives on to report that."""
    log = tmp_path / "signalled.log"
    run = probe(zygote, log, "75", "--until-signalled")
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text():  # its handler is in place
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    os.kill(zygote.process.pid, signal.SIGTERM)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 75
    assert zygote.process.poll() is None
    assert probe(zygote, tmp_path / "after.log").wait(timeout=60) == 0


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_zygote_that_dies_takes_its_runs_with_it_and_says_so(tmp_path):
    """Its runs' exit statuses die with the zygote (only a parent can reap them): each is
    killed and reported killed at once, so no wait of the sweep's can hang on it."""
    here = os.getcwd()
    os.chdir(TESTS)
    try:
        doomed = preload.Preloaded()
        log = tmp_path / "orphan.log"
        run = probe(doomed, log, "0", "--until-signalled", env=dict(os.environ))
    finally:
        os.chdir(here)
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text():
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    doomed.process.kill()
    assert run.wait(timeout=30) == -signal.SIGKILL
    doomed.process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not gone(run.pid):  # killed, and reaped by whoever it was left to
        assert time.monotonic() < deadline, f"run {run.pid} still alive"
        time.sleep(0.05)
    with (tmp_path / "after.log").open("a") as out, pytest.raises(preload.Refused, match="the zygote is gone"):
        doomed.start([*PROBE], dict(os.environ), out)
