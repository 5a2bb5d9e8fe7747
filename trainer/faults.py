"""Faults: preemption signals, stalled steps, what a rank says when a collective fails, and
the fault-injection points the tests and drills use.

A multi-node job must either make progress or fail fast with a message that says why. The
collective timeout (`dist.timeout_s`, set in trainer/distributed.py) guarantees the "fail";
this module makes the failure explain itself, and turns a preemption notice into a saved
checkpoint:

- `Preemption`: a signal handler that only sets a flag; the ranks agree on the flag at step
  boundaries, and the loop saves and exits with `EXIT_PREEMPTED`.
- `Watchdog`: a thread that notices a step far slower than the recent median, before the
  collective timeout fires, and reports which peers have gone quiet along with this rank's
  Python stacks. Every rank runs one, so every local rank of a stalled job dumps its stacks.
- `sigkill_step`, `sigkill_in_save_step`: real, unannounced deaths at chosen points.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from trainer import distributed
from trainer.distributed import DistEnv

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". The checkpoint is saved, and a
# relaunch (Slurm requeue, Kubernetes restart) resumes from it.
EXIT_PREEMPTED = 75


# --- fault injection: real faults at chosen points, for the tests and drills ---------------


def _for_this_rank(variable: str, dist_env: DistEnv) -> list[str] | None:
    """`VARIABLE=RANK:ARGS...` split, if RANK is this rank or `*`; None otherwise. Only in a
    launch's first attempt, so that workers torchrun restarts get past the fault, unless
    RANK names another (`RANK@N`: in the workers of torchrun's restart N)."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    rank, *args = spec.split(":")
    rank, _, attempt = rank.partition("@")
    if int(attempt or 0) != dist_env.restart_count:
        return None
    return args if rank in ("*", str(dist_env.rank)) else None


def sigkill_step(dist_env: DistEnv) -> int | None:
    """`TRAINER_FAULT_SIGKILL=RANK:STEP`: the step at which this rank SIGKILLs itself, if any:
    a real, unannounced process death, so kill-and-resume runs can be compared with
    uninterrupted ones point by point."""
    args = _for_this_rank("TRAINER_FAULT_SIGKILL", dist_env)
    return int(args[0]) if args else None


def raise_step(dist_env: DistEnv) -> int | None:
    """`TRAINER_FAULT_RAISE=RANK:STEP` (RANK may be `*`): this rank raises an exception as
    STEP begins, as a bad batch, an OOM or a NaN check would."""
    args = _for_this_rank("TRAINER_FAULT_RAISE", dist_env)
    return int(args[0]) if args else None


def overflow_step(dist_env: DistEnv) -> int | None:
    """`TRAINER_FAULT_OVERFLOW=RANK:STEP` (RANK may be `*`): this rank's gradients hold an
    inf at STEP, after their all-reduce, as an fp16 loss scale too high for them makes (give
    every rank, `*`: a real overflow reaches all of them through the all-reduce)."""
    args = _for_this_rank("TRAINER_FAULT_OVERFLOW", dist_env)
    return int(args[0]) if args else None


def sigstop_point(dist_env: DistEnv) -> tuple[str, int] | None:
    """`TRAINER_FAULT_SIGSTOP=RANK:PHASE:STEP` (RANK may be `*`; PHASE one of `PHASES`): this
    rank freezes itself (SIGSTOP) as it enters that phase of that step, as a node that stops
    answering does."""
    args = _for_this_rank("TRAINER_FAULT_SIGSTOP", dist_env)
    return (args[0], int(args[1])) if args else None


def sigkill_in_save_step() -> int | None:
    """`TRAINER_FAULT_SIGKILL_IN_SAVE=STEP`: rank 0 SIGKILLs itself inside the write of
    checkpoint STEP, after its files and before its completion marker."""
    spec = os.environ.get("TRAINER_FAULT_SIGKILL_IN_SAVE")
    return int(spec) if spec else None


def sigkill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(RuntimeError):
    """What TRAINER_FAULT_RAISE raises: any crash of a rank mid-run."""


class StepFaults:
    """The faults injected into a step (TRAINER_FAULT_SIGKILL, TRAINER_FAULT_RAISE as it
    begins; TRAINER_FAULT_OVERFLOW once its gradients are ready)."""

    def __init__(self, dist_env: DistEnv):
        self.kill_at, self.raise_at = sigkill_step(dist_env), raise_step(dist_env)
        self.overflow_at, self.step = overflow_step(dist_env), 0

    def at_step(self, step: int) -> None:
        self.step = step
        if step == self.kill_at:
            sigkill_now()
        if step == self.raise_at:
            raise InjectedFault(f"TRAINER_FAULT_RAISE: injected at step {step}")

    def gradients_ready(self, model: torch.nn.Module) -> None:
        if self.step == self.overflow_at:
            # The classifier's: the word embedding's gradient may live in a buffer that outlives
            # the step (parallel.SparseEmbeddingGrad clears only the rows a step wrote).
            [p for p in model.parameters() if p.grad is not None][-1].grad.view(-1)[0] = float("inf")


_received: set[str] = set()


def received_signals() -> frozenset[str]:
    """Every preemption signal this process has received: what a launcher needs to tell a
    time limit (requeue) from a cancellation (don't) after a preemption exit."""
    return frozenset(_received)


class Preempted(Exception):
    def __init__(self, step: int, signal_name: str):
        super().__init__(f"preempted by {signal_name}: saved the checkpoint of step {step}")
        self.step = step


class Preemption:
    """A preemption signal sets a flag; all ranks agree on it at a step boundary.

    The handler never saves, and never touches a collective or the disk. It runs between two
    bytecodes of the main thread, which may be halfway through a gradient all-reduce or a
    checkpoint write: saving from there would tear the file, or enter a collective that the
    other ranks never join, and hang the job until the scheduler kills it and the work with
    it. Instead every rank contributes its flag to an all-reduce at every step boundary, so
    all ranks see the same answer at the same step, and all of them call save together.
    """

    def __init__(self, signal_names: list[str], dist_env: DistEnv):
        self.dist_env = dist_env
        self.received: str | None = None
        self._pending: tuple[object, torch.Tensor] | None = None
        # Given back in close(): a launcher such as submitit has its own handlers to run
        # once the checkpoint is safe.
        self._previous = {name: signal.signal(getattr(signal, name), self._on_signal) for name in signal_names}

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name
        _received.add(self.received)

    def agreed(self) -> str | None:
        """Called by every rank at every step boundary: the signal's name once any rank has
        one, the same on all ranks, else None.

        The flag's all-reduce runs on the CPU control group (gloo) in the background while
        the next step computes, and is read one boundary later. So the check costs no
        device sync and no latency; a signal costs at most one more step before the save.
        """
        if not self.dist_env.is_distributed:
            return self.received
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item():
                return self.received or "a preemption signal on another rank"
        self._pending = distributed.any_rank_async(self.received is not None)
        return None

    def close(self, clean_exit: bool) -> None:
        """Give the signals back to their previous handlers. After a clean exit, also
        complete the last in-flight flag all-reduce (every rank has one) before teardown;
        after a failure a peer may never join it."""
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)
        if clean_exit and self._pending is not None:
            self._pending[0].wait()
            self._pending = None


class Heartbeats:
    """Each rank's current step and time, in the rendezvous store, read when a step stalls.

    A separate store client with a short timeout: the watchdog must not block for the
    process group's long init timeout when the store's host is the node that went away.
    """

    TIMEOUT_S = 5.0

    def __init__(self, dist_env: DistEnv):
        self.dist_env = dist_env
        # Not keyed by restart: nodes count restarts separately. A predecessor's record is
        # overwritten within heartbeat_s by the live rank, and until then reads as stale.
        self.prefix = "trainer/heartbeat"
        self._store = None

    def _client(self):
        if self._store is None:
            self._store = dist.TCPStore(
                self.dist_env.master_addr, self.dist_env.master_port, is_master=False,
                timeout=timedelta(seconds=self.TIMEOUT_S), wait_for_workers=False,
            )
        return self._store

    def beat(self, step: int) -> None:
        record = {"step": step, "time": time.time(), "host": socket.gethostname()}
        self._client().set(f"{self.prefix}/{self.dist_env.rank}", json.dumps(record))

    def peers(self, my_step: int, stale_after_s: float) -> list[str]:
        """One line per other rank: quiet (no heartbeat lately), behind, or waiting with us."""
        store, now, lines = self._client(), time.time(), []
        for rank in range(self.dist_env.world_size):
            if rank == self.dist_env.rank:
                continue
            key = f"{self.prefix}/{rank}"
            if not store.check([key]):
                lines.append(f"rank {rank}: no heartbeat yet")
                continue
            beat = json.loads(store.get(key))
            age = now - beat["time"]
            where = f"rank {rank} on {beat['host']}"
            if age > stale_after_s:
                lines.append(f"{where}: NOT RESPONDING, last heartbeat {age:.1f}s ago at step {beat['step']}")
            elif beat["step"] < my_step:
                lines.append(f"{where}: behind, at step {beat['step']}")
            else:
                lines.append(f"{where}: alive, at step {beat['step']}")
        return lines


PHASES = {
    # id (for TRAINER_FAULT_SIGSTOP): what the report calls it
    "step": "train step",
    "first-step": "the first step's timeout switch",
    "log": "log",
    "eval": "eval",
    "save": "checkpoint save",
    "preemption": "preemption agreement",
    "final-eval": "final eval",
    "export": "final export",
    "gather": "end-of-run gather",
}


@dataclass(frozen=True)
class _Watch:
    phase: str
    step: int
    started: float
    limit: float


class Watchdog:
    """Reports a rank stuck anywhere a collective can wait, with stacks, before the timeout.

    It watches the train step and every phase outside it that enters a collective (the log
    all-reduce, eval, checkpoint save, the preemption agreement, the final eval and export,
    the end-of-run gather). The limit for a step is `slow_step_factor` x the median of recent
    steps, at least `slow_step_min_s`; for the other phases, whose length is not a pattern,
    it is the point a collective would be near its timeout. Every limit stays under the
    collective timeout then in force: the report must come while the job is still alive to
    explain itself. Until a first step has been timed, it follows the long init timeout.
    """

    POLL_S = 0.5

    def __init__(self, cfg: DictConfig, dist_env: DistEnv, output_dir: Path):
        self.dist_env = dist_env
        self.factor, self.min_s = cfg.fault.slow_step_factor, cfg.fault.slow_step_min_s
        self.heartbeat_s = cfg.fault.heartbeat_s
        self.timeout_s = cfg.dist.init_timeout_s
        self.stacks_file = output_dir / "stacks" / f"rank-{dist_env.rank}.txt"
        self.nccl_dump = distributed.nccl_dump_prefix(dist_env)
        self.heartbeats = Heartbeats(dist_env) if dist_env.is_distributed else None
        self.durations: deque[float] = deque(maxlen=50)
        # What runs now, else None: one object, swapped whole, so the thread reads a
        # consistent view without a lock.
        self._watching: _Watch | None = None
        self.step = 0  # the step in progress, or the last one done
        self._reported: _Watch | None = None
        self._sigstop_at = sigstop_point(dist_env)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        # Python stacks on SIGABRT/SIGSEGV too: the NCCL watchdog aborts a timed-out rank.
        faulthandler.enable(file=sys.stderr, all_threads=True)

    def start(self) -> None:
        if self.heartbeats is not None:  # a first heartbeat now: a peer that freezes early still left one
            self.heartbeats.beat(self.step)
        self._thread.start()

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def step_started(self, step: int) -> None:
        if self.durations:
            limit = max(self.min_s, self.factor * statistics.median(self.durations))
        else:
            limit = self.timeout_s
        self.step = step
        self._enter("step", step, limit)

    def step_done(self) -> None:
        self.durations.append(time.monotonic() - self._watching.started)
        self._watching = None

    @contextmanager
    def phase(self, phase: str, step: int) -> Iterator[None]:
        """Watch a phase outside the train step (`phase`: a key of PHASES)."""
        self._enter(phase, step, self.timeout_s)
        try:
            yield
        finally:
            self._watching = None

    def _enter(self, phase: str, step: int, limit: float) -> None:
        self._watching = _Watch(phase, step, time.monotonic(), min(limit, 0.75 * self.timeout_s))
        if self._sigstop_at == (phase, step):
            os.kill(os.getpid(), signal.SIGSTOP)  # a fault-injection point: this rank stops answering

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.POLL_S)

    # --- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        last_beat = float("-inf")
        while not self._stop.wait(self.POLL_S):
            now = time.monotonic()
            watching = self._watching
            if watching is not None and now - watching.started > watching.limit and watching is not self._reported:
                self._reported = watching
                median = f"recent step median {statistics.median(self.durations):.2f}s, " if self.durations else ""
                self.report(f"stalled in {PHASES[watching.phase]} at step {watching.step}: has run "
                            f"{now - watching.started:.1f}s ({median}limit {watching.limit:.1f}s); "
                            "the job may be hung")
            if self.heartbeats is not None and now - last_beat >= self.heartbeat_s:
                last_beat = now
                try:
                    self.heartbeats.beat(self.step)
                except Exception as e:  # the store's node is gone; the report will say so
                    log.debug("heartbeat failed: %s", e)

    # --- reporting --------------------------------------------------------------------

    def report(self, what: str) -> None:
        """Log `what`, the state of every peer, and this rank's Python stacks (all threads)."""
        lines = [f"rank {self.dist_env.rank} on {socket.gethostname()}: {what}"]
        if self.heartbeats is not None:
            try:
                lines += ["  " + line for line in self.heartbeats.peers(self.step, 3 * self.heartbeat_s)]
            except Exception as e:
                lines.append(f"  rendezvous store {self.dist_env.master_addr}:{self.dist_env.master_port} "
                             f"unreachable ({type(e).__name__}: {e}); this node may be the one cut off")
        if self.nccl_dump is not None:
            lines.append(f"  NCCL's flight recorder dumps this rank's collectives to {self.nccl_dump}{self.dist_env.rank} "
                         "when NCCL's own watchdog times out (README, \"Hangs and lost nodes\")")
        lines.append(f"  Python stacks of rank {self.dist_env.rank} follow, and are kept in {self.stacks_file}")
        message = "\n".join(lines)
        log.error("%s", message)
        dump_stacks(message, self.stacks_file)


def dump_stacks(header: str, path: Path) -> None:
    """All threads' Python stacks to stderr and appended to `path`. faulthandler writes
    straight to the file descriptor, so this works even while the main thread is blocked
    inside a C++ collective holding no GIL-visible state."""
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{header}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError as e:
        log.warning("could not write %s: %s", path, e)
