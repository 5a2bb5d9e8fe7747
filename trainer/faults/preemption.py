"""Preemption: a signal that means "save and stop" becomes a checkpoint and exit code 75.

A signal handler only sets a flag; the ranks agree on the flag at step boundaries, and the
loop saves and exits with `Exit.PREEMPTED`.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

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
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
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
        device sync and no latency; a signal costs at most one more step before the save (two
        where it arrives while the ranks evaluate or save, after this boundary's check).
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
