"""A sweep's trials held still where a test needs them: each trial's rank stops itself
(TRAINER_FAULT_SIGSTOP, trainer/faults/inject.py) as a phase begins, and the test lets it go
once the sweep has reached the state it waits for, however fast or slow the runs train."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from support.runs import Run, launch

HOLD_S = 300
"""The longest a test holds a trial's rank frozen waiting for the sweep: only a hang reaches it."""


def frozen_ranks(trials_dir: Path) -> dict[int, str]:
    """The trials' ranks stopped by TRAINER_FAULT_SIGSTOP, by pid, each with its trial's id: the
    stopped processes whose stdout is a trial's trial.log (the sweep starts each run with it,
    and a run's processes inherit it)."""
    found = {}
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] != psutil.STATUS_STOPPED:
            continue
        with contextlib.suppress(OSError):
            log = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
            if log.name == "trial.log" and log.parent.parent == trials_dir:
                found[proc.pid] = log.parent.name
    return found


def holding_ranks(out: Path, running: Callable[[], bool], release: Callable[[dict[int, str]], list[int]]) -> None:
    """While `running()` (the sweep writing into `out` has not exited): each trial's rank that
    TRAINER_FAULT_SIGSTOP froze is let go (SIGCONT) once `release(frozen)`, given the ranks
    frozen now (pid: trial), names it. Fails if a rank is held HOLD_S (the sweep never got
    where the test waits for it); a rank still frozen at the end, as after a failure, is killed."""
    trials_dir = (out / "trials").resolve()
    held_since: dict[int, float] = {}
    try:
        while running():
            frozen = frozen_ranks(trials_dir)
            for pid in release(frozen):
                os.kill(pid, signal.SIGCONT)
                del frozen[pid]
            now = time.monotonic()
            held_since = {pid: held_since.get(pid, now) for pid in frozen}
            stuck = sorted(frozen[pid] for pid, since in held_since.items() if now - since > HOLD_S)
            assert not stuck, f"trials {stuck}: a rank held frozen {HOLD_S}s, the sweep never got on"
            time.sleep(0.2)  # the poll of observable state, as support.processes.wait_for's
    finally:
        for pid in frozen_ranks(trials_dir):  # a failed test leaves no rank stopped for good
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sweep_holding_ranks(command: list[str], out: Path, freeze: str,
                        release: Callable[[dict[int, str]], list[int]]) -> Run:
    """`launch(command)` with TRAINER_FAULT_SIGSTOP=0:`freeze` (PHASE:STEP): each trial's rank
    stops itself (SIGSTOP) there, and is let go as `holding_ranks` says. A test then sees the
    sweep reach a state with its runs held still, however fast they train, instead of racing
    a poll against them."""
    with ThreadPoolExecutor(1) as pool:
        sweep = pool.submit(launch, command, {"TRAINER_FAULT_SIGSTOP": f"0:{freeze}"}, 400)
        holding_ranks(out, lambda: not sweep.done(), release)
    return sweep.result()
