"""Fault injection: real faults at chosen points of a run, for the tests and drills.

The product marks each place a fault can be injected between steps with one line,
`inject.point(NAME, step, ...)`; inside the training step, `into_step` wraps the step's
`gradients_ready` only where a fault is armed there. Which faults fire is read once from the
environment by `configure(dist_env)`, when the Trainer is built; with no TRAINER_FAULT_*
variable set, a point is a dict lookup.

    variable                                point (where in the run)                      fault
    TRAINER_FAULT_SIGKILL=RANK:STEP         "step": a train step begins                    SIGKILL
    TRAINER_FAULT_RAISE=RANK:STEP           "step"                                         InjectedFault
    TRAINER_FAULT_SIGTERM=RANK:STEP         "step"                                         SIGTERM (a preemption)
    TRAINER_FAULT_NAN=RANK:STEP[:TRIES],... "loss": the step's loss, after backward, in    a NaN loss and
                                            STEP's first TRIES tries (default 1); several, NaN gradients
                                            comma-separated
    TRAINER_FAULT_OVERFLOW=RANK:STEP        "gradients": all-reduced, not yet unscaled     an inf in them
    TRAINER_FAULT_CORRUPT=RANK:STEP         "weights": the optimizer has stepped            a flipped bit
    TRAINER_FAULT_SIGSTOP=RANK:PHASE:STEP   "phase:PHASE": the watchdog starts watching    SIGSTOP
                                            PHASE (a key of watchdog.PHASES)
    TRAINER_FAULT_SIGKILL_IN_SAVE=STEP      "checkpoint-files-written": rank 0's files     SIGKILL
                                            are written, the completion marker is not

    TRAINER_FAULT_SCORE_SIGKILL=SHARD:N:AT  `score`'s chunk N of SHARD, AT `scored` (its    SIGKILL
                                            answers in memory, not committed) or
                                            `committed` (before the next chunk)
    TRAINER_FAULT_SCORE_SIGSTOP=SHARD:N:AT  the same                                      SIGSTOP

RANK is a global rank or `*` (every rank). A RANK fault fires only in a launch's first
attempt, so that the workers torchrun restarts get past it, unless RANK says `RANK@N`: in the
workers of torchrun's restart N. TRAINER_FAULT_SIGKILL_IN_SAVE has no RANK: only rank 0
writes, in every attempt.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trainer.faults import replicas
from trainer.runtime.environment import DistEnv

_armed: dict[tuple[str, int], list[Callable[..., None]]] = {}
"""(point, step): the faults to run there, in the order the table above lists them."""


_BETWEEN_STEPS = ("TRAINER_FAULT_SIGKILL", "TRAINER_FAULT_RAISE", "TRAINER_FAULT_SIGTERM", "TRAINER_FAULT_CORRUPT",
                  "TRAINER_FAULT_SIGSTOP", "TRAINER_FAULT_SIGKILL_IN_SAVE")
_between_steps = [False]


def between_steps() -> bool:
    """Whether a fault acting between steps is set for any rank (the same answer on every
    rank: they share the environment). The loop then reads each step's verdict at once, so
    that the fault meets the run where it always has (trainer/train/loop.py)."""
    return _between_steps[0]


class _Step(Protocol):
    """What `into_step` wraps of trainer/train/step.py's TrainStep."""

    model: Any

    def gradients_ready(self, step: int, step_loss: Any) -> None: ...


def into_step(train_step: _Step) -> None:
    """Wrap the training step's `gradients_ready` (after the last backward, before the
    gradients are unscaled and clipped) with the faults armed at "loss" and "gradients". With
    none armed nothing is wrapped: the step runs as it does in any run."""
    if not any(name in ("loss", "gradients") for name, _ in _armed):
        return
    ready = train_step.gradients_ready

    def gradients_ready(step: int, step_loss: Any) -> None:
        ready(step, step_loss)
        point("loss", step, loss=step_loss, model=train_step.model)
        point("gradients", step, model=train_step.model)

    train_step.gradients_ready = gradients_ready  # type: ignore[method-assign]


def point(name: str, step: int, **context) -> None:
    """A fault-injection point: run the faults armed for `name` at `step`. `context` is what
    a fault there works on (`model=` at "gradients")."""
    for fault in _armed.get((name, step), ()):
        fault(step, **context)


class InjectedFault(RuntimeError):
    """What TRAINER_FAULT_RAISE raises: any crash of a rank mid-run."""


def _sigkill(step: int, **_) -> None:
    # A real, unannounced death: kill-and-resume runs are compared with uninterrupted ones.
    os.kill(os.getpid(), signal.SIGKILL)


def _sigterm(step: int, **_) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption notice reaches a rank


def _sigstop(step: int, **_) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # as a node that stops answering


def _raise(step: int, **_) -> None:
    raise InjectedFault(f"TRAINER_FAULT_RAISE: injected at step {step}")


def _overflow(step: int, model, **_) -> None:
    # As an fp16 loss scale too high for the gradients makes; give it every rank (`*`): a real
    # overflow reaches all of them through the all-reduce. The classifier's gradient: the word
    # embedding's may live in a buffer that outlives the step (parallel.SparseEmbeddingGrad
    # clears only the rows a step wrote).
    [p for p in model.parameters() if p.grad is not None][-1].grad.view(-1)[0] = float("inf")


def _nan(tries: int) -> Callable[..., None]:
    """A NaN loss, whose gradients are NaN too, as a real one's are, in the first `tries`
    tries of its step (a skipped step is tried again, with the next batch)."""
    left = [tries]

    def poison(step: int, loss, model, **_) -> None:
        # After backward, once the try is known to be one of STEP's (trainer/train/step.py reads the
        # verdict of the try before it only then): this rank's loss and gradients.
        if left[0] > 0:
            left[0] -= 1
            loss.data.fill_(float("nan"))
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.fill_(float("nan"))

    return poison


def _corrupt(step: int, model, **_) -> None:
    # Silent data corruption: the lowest bit of one weight of this replica flips, as a bad
    # GPU or memory would flip it; nothing fails, and the model barely changes.
    replicas.bits(next(model.parameters()).data)[:1] ^= 1


def configure(dist_env: DistEnv, environ: Mapping[str, str] = os.environ) -> None:
    """Arm the faults the TRAINER_FAULT_* variables give this rank in this attempt, and
    disarm all others."""
    _armed.clear()
    _between_steps[0] = any(environ.get(variable) for variable in _BETWEEN_STEPS)

    def arm(name: str, step: str, fault: Callable[..., None]) -> None:
        _armed.setdefault((name, int(step)), []).append(fault)

    if args := _for_this_rank(environ, "TRAINER_FAULT_SIGKILL", dist_env):
        arm("step", args[0], _sigkill)
    if args := _for_this_rank(environ, "TRAINER_FAULT_RAISE", dist_env):
        arm("step", args[0], _raise)
    if args := _for_this_rank(environ, "TRAINER_FAULT_SIGTERM", dist_env):
        arm("step", args[0], _sigterm)
    for nan in filter(None, environ.get("TRAINER_FAULT_NAN", "").split(",")):
        if args := _for_this_rank({"TRAINER_FAULT_NAN": nan}, "TRAINER_FAULT_NAN", dist_env):
            arm("loss", args[0], _nan(int(args[1]) if len(args) > 1 else 1))
    if args := _for_this_rank(environ, "TRAINER_FAULT_OVERFLOW", dist_env):
        arm("gradients", args[0], _overflow)
    if args := _for_this_rank(environ, "TRAINER_FAULT_CORRUPT", dist_env):
        arm("weights", args[0], _corrupt)
    if args := _for_this_rank(environ, "TRAINER_FAULT_SIGSTOP", dist_env):
        arm(f"phase:{args[0]}", args[1], _sigstop)
    if spec := environ.get("TRAINER_FAULT_SIGKILL_IN_SAVE"):
        arm("checkpoint-files-written", spec, _sigkill)


def _for_this_rank(environ: Mapping[str, str], variable: str, dist_env: DistEnv) -> list[str] | None:
    """`VARIABLE=RANK[@N]:ARGS...`'s ARGS, if the fault is this rank's in this attempt."""
    spec = environ.get(variable)
    if not spec:
        return None
    rank, *args = spec.split(":")
    rank, _, attempt = rank.partition("@")
    if int(attempt or 0) != dist_env.restart_count:
        return None
    return args if rank in ("*", str(dist_env.rank)) else None


def scoring(at: str, shard: str, index: int, environ: Mapping[str, str] = os.environ) -> None:
    """The `score` worker's points: a chunk `scored` (not yet committed) or `committed`."""
    here = f"{shard}:{index}:{at}"
    if environ.get("TRAINER_FAULT_SCORE_SIGKILL") == here:
        os.kill(os.getpid(), signal.SIGKILL)
    if environ.get("TRAINER_FAULT_SCORE_SIGSTOP") == here:  # held still there, its claims with it, until SIGCONT
        os.kill(os.getpid(), signal.SIGSTOP)
