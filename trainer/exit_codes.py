"""The restart contract: what the job's exit code tells a scheduler to do next.

Every launcher compiles these codes into its own restart rules (slurm/ddp.sh's requeue,
submitit's checkpoint, the PyTorchJob's restartPolicy, the TrainJob's failure policy, compose's
exit code); docs/restarts.md has the table. torchrun hides them (it exits 1 whatever its
workers did), so launchers run `python -m trainer.cli.torchrun` (trainer/cli/torchrun.py), which
passes on the most severe of its workers' codes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from enum import IntEnum


class Exit(IntEnum):
    DONE = 0
    CRASH = 1
    """A bug or an unexplained failure. Retryable under the launcher's budget: a crash the
    code makes again ends as NO_PROGRESS."""
    USAGE = 2
    """The config, the data, the launch environment: the same job fails the same way. Never retry."""
    PREEMPTED = 75
    """A signal asked the job to stop, and every rank saved a checkpoint: start it again,
    anywhere (EX_TEMPFAIL)."""
    NODE_FAULT = 76
    """A peer stopped responding, or this node's GPU or its network failed: retry, better on
    other nodes (the suspects are written to $TRAINER_NODE_FAULTS)."""
    NO_PROGRESS = 77
    """The last restarts all resumed from the same checkpoint and failed again, or a step's
    loss stayed non-finite after a rollback: retrying would only burn the allocation. Stop,
    and look at the logs."""


MEANING = {
    Exit.DONE: "done",
    Exit.CRASH: "crashed (retryable)",
    Exit.USAGE: "usage error (do not retry)",
    Exit.PREEMPTED: "preempted after a checkpoint (restart)",
    Exit.NODE_FAULT: "node fault (retry on other nodes)",
    Exit.NO_PROGRESS: "no progress across restarts (do not retry)",
}

# When ranks disagree, the one that tells the launcher most: a usage error on one rank is
# a usage error of the job; a preempted rank beside a crashed one was only stopped.
_SEVERITY = [Exit.USAGE, Exit.NO_PROGRESS, Exit.NODE_FAULT, Exit.CRASH, Exit.PREEMPTED, Exit.DONE]

RETRYABLE = frozenset({Exit.CRASH, Exit.PREEMPTED, Exit.NODE_FAULT})

RETRYABLE_ENV = "TRAINER_RETRYABLE_EXIT_CODE"
"""Set, every retryable verdict exits with this code instead: 138 (128 + SIGUSR1, the code
kept for "retry me") for a PyTorchJob with `restartPolicy: ExitCode`, whose operator takes
every code below 128 as permanent."""

NODE_FAULTS_ENV = "TRAINER_NODE_FAULTS"
"""A file the ranks append the hostnames they suspect to, one per line, on a NODE_FAULT."""

TERMINATED = 128 + signal.SIGTERM
"""143: what `python -m trainer.cli.torchrun` exits with when a TERM stopped it (128+N, as a
shell reports a process stopped by signal N)."""


def of(code: int) -> Exit:
    """A worker's or a node's exit code as a verdict: one of ours, else a crash (a signal's
    negative code included: the OOM killer's SIGKILL is not a reason to stop retrying).

    TERMINATED (143) is PREEMPTED: a torchrun stopped by TERM (a preemption, scancel, the
    ddp.sh relay's time-limit TERM) has forwarded it to its workers, which take it for a
    preemption signal and save before exiting; torchrun then cannot report their 75 and
    exits 143 instead. Our workers do not exit 143: one stopped by a TERM it did not handle
    is reported as -15, a crash. slurm/requeue.py, which cannot import this package, keeps a
    copy of this table; tests/unit/test_slurm_requeue.py holds the two equal."""
    if code == TERMINATED:
        return Exit.PREEMPTED
    try:
        return Exit(code)
    except ValueError:
        return Exit.CRASH


def worst(codes: Iterable[int]) -> Exit:
    """The verdict of the job from its failed workers' exit codes, or from its nodes' torchruns'."""
    verdicts = {of(code) for code in codes}
    return next((v for v in _SEVERITY if v in verdicts), Exit.DONE)


def for_launcher(verdict: Exit, environ=os.environ) -> int:
    """The process exit code for `verdict`, in the launcher's dialect when it asked for one."""
    retryable_as = environ.get(RETRYABLE_ENV, "")
    if retryable_as and verdict in RETRYABLE:
        return int(retryable_as)
    return int(verdict)


def record_suspect(host: str, environ=os.environ) -> None:
    """Name `host` in the launcher's node-fault file, if it gave one. Appends of one short
    line are atomic on local and NFS files, so ranks writing together never interleave."""
    path = environ.get(NODE_FAULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(host + "\n")
