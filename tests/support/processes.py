"""Processes against a deadline: wait for what a test observes, read a process's signal masks, end a
process group and everything under it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil


def wait_for(predicate, timeout: float, what, procs: dict[str, subprocess.Popen] | None = None,
             interval: float = 0.2):
    """Poll until `predicate()` returns something truthy, and return it. Fails at `timeout`
    saying `what` it waited for (a string, or a callable that describes the state then), and
    fails early if one of `procs` has already exited."""
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        if procs and any(p.poll() is not None for p in procs.values()):
            raise AssertionError(f"a process exited while waiting for {_text(what)}: "
                                 f"{ {name: p.returncode for name, p in procs.items()} }")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {_text(what)}")
        time.sleep(interval)
    return found


def _text(what) -> str:
    return what() if callable(what) else what


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """The exit codes of `procs` in order, all waited for against one deadline `timeout`
    seconds from now; None for each still running then (left running)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def signals_in(pid: int, *masks: str) -> set[int]:
    """The signals set in any of the /proc/PID/status `masks` (SigBlk: blocked; SigPnd and
    ShdPnd: pending for the thread, for the process)."""
    status = Path(f"/proc/{pid}/status").read_text()
    bits = 0
    for mask in masks:
        bits |= int(re.search(rf"^{mask}:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return {signum for signum in signal.valid_signals() if bits >> (signum - 1) & 1}


def killpg(pgid: int) -> None:
    """SIGKILL the process group `pgid` (a process started with start_new_session=True has
    its pid as its group's), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and every descendant: torchrun starts each worker in a
    session of its own, and a hung worker would hold the output pipe open forever."""
    descendants = []
    if proc.poll() is None:  # once it is reaped, its pid may be another process's
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants = psutil.Process(proc.pid).children(recursive=True)
    killpg(proc.pid)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
