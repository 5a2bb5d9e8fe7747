"""The stall watchdog: a rank stuck in a step or a collective says so, with stacks, in time.

A multi-node job must either make progress or fail fast with a message that says why. The
collective timeout (`dist.timeout_s`, set in trainer/runtime/distributed.py) guarantees the "fail";
the `Watchdog` makes the failure explain itself. It notices a step far slower than the
recent median, before the collective timeout fires, and reports which peers have gone quiet
(`Heartbeats`) along with this rank's Python stacks (`dump_stacks`). Every rank runs one, so
every local rank of a stalled job dumps its stacks.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import exit_codes
from trainer.config.schema import Config
from trainer.errors import describe
from trainer.exit_codes import Exit
from trainer.faults import inject
from trainer.faults.replicas import ReplicasDiverged
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

log = logging.getLogger(__name__)


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
        self._store: dist.TCPStore | None = None

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

    def peers(self, my_step: int, stale_after_s: float) -> list[tuple[str, str | None]]:
        """Each other rank: a line saying whether it is quiet (no heartbeat lately), behind, or
        waiting with us; and its host if it is quiet, else None."""
        store, now = self._client(), time.time()
        peers: list[tuple[str, str | None]] = []
        for rank in range(self.dist_env.world_size):
            if rank == self.dist_env.rank:
                continue
            key = f"{self.prefix}/{rank}"
            if not store.check([key]):
                peers.append((f"rank {rank}: no heartbeat yet", None))
                continue
            beat = json.loads(store.get(key))
            age = now - beat["time"]
            where = f"rank {rank} on {beat['host']}"
            if age > stale_after_s:
                peers.append((f"{where}: NOT RESPONDING, last heartbeat {age:.1f}s ago at step {beat['step']}",
                              beat["host"]))
            elif beat["step"] < my_step:
                peers.append((f"{where}: behind, at step {beat['step']}", None))
            else:
                peers.append((f"{where}: alive, at step {beat['step']}", None))
        return peers


PHASES = {
    # id (for TRAINER_FAULT_SIGSTOP): what the report calls it
    "step": "train step",
    "first-step": "the first step's timeout switch",
    "log": "log",
    "eval": "eval",
    "save": "checkpoint save",
    "replicas": "replica comparison",
    "preemption": "preemption agreement",
    "rollback": "rollback to the newest checkpoint",
    "final-eval": "final eval",
    "load-best": "best checkpoint load",
    "test-eval": "test eval",
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
    all-reduce, eval, checkpoint save, the preemption agreement, the final and test evals,
    the best checkpoint's load, the export, the end-of-run gather). The limit for a step is
    `slow_step_factor` x the median of recent steps, at least `slow_step_min_s`; for the
    other phases, whose length is not a pattern, it is the point a collective would be near
    its timeout. Every limit stays under the
    collective timeout then in force: the report must come while the job is still alive to
    explain itself. Until a first step has been timed, it follows the long init timeout.
    """

    POLL_S = 0.5

    def __init__(self, cfg: Config, dist_env: DistEnv, output_dir: Path,
                 clock: Callable[[], float] = time.monotonic):
        self.dist_env = dist_env
        self.clock = clock
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
        self.silent_hosts: set[str] = set()
        """The hosts of the peers a report found not responding since the last step done."""
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
        limit = max(self.min_s, self.factor * statistics.median(self.durations)) if self.durations else self.timeout_s
        self.step = step
        self._enter("step", step, limit)

    def step_done(self) -> None:
        watching = self._watching
        assert watching is not None, "step_done() follows step_started(), which set it"
        self.durations.append(self.clock() - watching.started)
        self._watching = None
        # Every peer took part in the step just done: a heartbeat that was late before is no
        # evidence against its node now, and must not turn a later bug into a node fault.
        self.silent_hosts.clear()

    @contextmanager
    def phase(self, phase: str, step: int) -> Iterator[None]:
        """Watch a phase outside the train step (`phase`: a key of PHASES)."""
        self._enter(phase, step, self.timeout_s)
        try:
            yield
        finally:
            self._watching = None

    def _enter(self, phase: str, step: int, limit: float) -> None:
        self._watching = _Watch(phase, step, self.clock(), min(limit, 0.75 * self.timeout_s))
        inject.point(f"phase:{phase}", step)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.POLL_S)

    # --- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        last_beat = float("-inf")
        while not self._stop.wait(self.POLL_S):
            now = self.clock()
            self.check(now)
            if self.heartbeats is not None and now - last_beat >= self.heartbeat_s:
                last_beat = now
                try:
                    self.heartbeats.beat(self.step)
                except Exception as e:  # the store's node is gone; the report will say so  # noqa: BLE001
                    log.debug("heartbeat failed: %s", e)

    def check(self, now: float) -> None:
        """Report what runs now if it has run past its limit at time `now` (of `clock`);
        each watched step or phase at most once."""
        watching = self._watching
        if watching is not None and now - watching.started > watching.limit and watching is not self._reported:
            self._reported = watching
            median = f"recent step median {statistics.median(self.durations):.2f}s, " if self.durations else ""
            self.report(f"stalled in {PHASES[watching.phase]} at step {watching.step}: has run "
                        f"{now - watching.started:.1f}s ({median}limit {watching.limit:.1f}s); "
                        "the job may be hung")

    # --- reporting --------------------------------------------------------------------

    def report(self, what: str) -> None:
        """Log `what`, the state of every peer, and this rank's Python stacks (all threads)."""
        lines = [f"rank {self.dist_env.rank} on {socket.gethostname()}: {what}"]
        if self.heartbeats is not None:
            try:
                for line, silent_host in self.heartbeats.peers(self.step, 3 * self.heartbeat_s):
                    lines.append("  " + line)
                    if silent_host is not None:
                        self.silent_hosts.add(silent_host)
            except Exception as e:  # the report goes out whatever the store raised  # noqa: BLE001
                lines.append(f"  rendezvous store {self.dist_env.master_addr}:{self.dist_env.master_port} "
                             f"unreachable ({describe(e)}); this node may be the one cut off")
        if self.nccl_dump is not None:
            lines.append("  NCCL's flight recorder dumps this rank's collectives to "
                         f"{self.nccl_dump}{self.dist_env.rank} when NCCL's own watchdog times out "
                         "(docs/faults.md, \"Hangs and lost nodes\")")
        lines.append(f"  Python stacks of rank {self.dist_env.rank} follow, and are kept in {self.stacks_file}")
        message = "\n".join(lines)
        log.error("%s", message)
        dump_stacks(message, self.stacks_file)


LOCAL_FAULTS = ("CUDA error", "cuda error", "unhandled system error")
"""Errors that point at this node's hardware: CUDA's own, NCCL's ncclUnhandledCudaError
("unhandled cuda error") and ncclSystemError ("unhandled system error": a failed call into
the OS or the network stack here, an InfiniBand port among them). Not ncclRemoteError
("remote process exited or there was a network error"): most often a peer that crashed."""


def verdict(error: BaseException, silent_hosts: set[str]) -> tuple[Exit, list[str]]:
    """What a failed step means for the scheduler (trainer/exit_codes.py), and the hosts to
    suspect: peers that stopped responding point at their nodes; replicas that diverged, at
    the odd ranks' nodes; a CUDA error other than an out-of-memory, or NCCL's system error, at
    this node. Anything else, a peer that crashed and closed its connections among them, is a
    crash."""
    if silent_hosts:
        return Exit.NODE_FAULT, sorted(silent_hosts)
    if isinstance(error, ReplicasDiverged):
        return Exit.NODE_FAULT, error.hosts
    message = str(error)
    if not isinstance(error, torch.cuda.OutOfMemoryError) and any(fault in message for fault in LOCAL_FAULTS):
        return Exit.NODE_FAULT, [socket.gethostname()]
    return Exit.CRASH, []


def judge(error: BaseException, silent_hosts: set[str]) -> Exit:
    """The verdict on `error`, with its suspects named in the log and to the launcher."""
    exit_code, suspects = verdict(error, silent_hosts)
    if suspects:
        log.error("node fault: suspect %s", ", ".join(suspects))
    for host in suspects:
        try:  # the verdict stands without the launcher's file
            exit_codes.record_suspect(host)
        except OSError as e:
            log.warning("suspect %s not recorded for the launcher: %s", host, e)
    return exit_code


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
