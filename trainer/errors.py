"""Problems a user can fix: one line naming what is wrong, exit code 2, no traceback.

Each kind says where to look: the config (a key), the launch environment (torchrun's
variables, the GPUs), the data (a file, a column, a label), or a checkpoint (one that cannot
be resumed from or written). Anything else is a bug or a crash, and keeps its traceback.
"""

import sys

from trainer.exit_codes import Exit

ONE_LINE_LIMIT = 300
"""The most characters of another library's message that an error line repeats."""


def report(message: object) -> int:
    """Print `error: MESSAGE` to stderr as one write, so that the lines of ranks failing at
    the same moment never interleave in a shared log; returns the exit code: a
    TrainerError's own, else Exit.USAGE."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return int(getattr(message, "exit_code", Exit.USAGE))


def one_line(e: BaseException) -> str:
    """Another library's exception as a part of our one-line messages: its first line (where
    Python and the libraries put the reason; what follows is context, hints or a dump of the
    input), runs of whitespace collapsed, cut at ONE_LINE_LIMIT characters ending in "...",
    which keeps a long path with its reason and a log of every rank reporting readable.
    "" for an exception without a message."""
    line = " ".join(str(e).strip().split("\n")[0].split())
    return line if len(line) <= ONE_LINE_LIMIT else line[:ONE_LINE_LIMIT - 3] + "..."


def describe(e: BaseException) -> str:
    """Another library's exception as every one-line message names it: `TypeName: its first
    line` (one_line), or the type alone for an exception without a message."""
    message = one_line(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


class TrainerError(Exception):
    """Printed as `error: <message>` on every rank that raises it; exit code 2."""

    exit_code = Exit.USAGE


class ConfigError(TrainerError):
    """A config key's value; the message starts with the key."""


class LaunchError(TrainerError):
    """The environment the job was launched into: torchrun's variables, GPUs, the launcher."""


class LeaseHeld(LaunchError):
    """Another job holds output_dir's lease (trainer/runtime/lease.py): one line naming it and the way
    out. Here, not in lease.py: a rank re-raises rank 0's error by its name in this module."""


class DataError(TrainerError):
    """The dataset: a file that cannot be read, a missing column, a label out of range."""


class CheckpointError(TrainerError):
    """A checkpoint that cannot be resumed from, or a save that failed (on every rank, with
    rank 0's reason)."""


class NoProgress(TrainerError):
    """The last restarts all failed from the same checkpoint (trainer/faults/attempts.py): retrying
    is pointless, and the exit code tells the launcher so."""

    exit_code = Exit.NO_PROGRESS
