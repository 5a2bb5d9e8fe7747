"""Problems a user can fix: one line naming what is wrong, exit code 2, no traceback.

Each kind says where to look: the config (a key), the launch environment (torchrun's
variables, the GPUs), the data (a file, a column, a label), or a checkpoint (one that cannot
be resumed from or written). Anything else is a bug or a crash, and keeps its traceback.
"""

import os
import sys
from pathlib import Path

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


class TrainerError(Exception):
    """Printed as `error: <message>` on every rank that raises it; exit code 2."""

    exit_code = Exit.USAGE


class ConfigError(TrainerError):
    """A config key's value; the message starts with the key."""


class LaunchError(TrainerError):
    """The environment the job was launched into: torchrun's variables, GPUs, the launcher."""


class DataError(TrainerError):
    """The dataset: a file that cannot be read, a missing column, a label out of range."""


class CheckpointError(TrainerError):
    """A checkpoint that cannot be resumed from, or a save that failed (on every rank, with
    rank 0's reason)."""


class NoProgress(TrainerError):
    """The last restarts all failed from the same checkpoint (trainer/attempts.py): retrying
    is pointless, and the exit code tells the launcher so."""

    exit_code = Exit.NO_PROGRESS


def make_writable_dir(path: Path) -> None:
    """Create the folder `path` (output_dir) through any link, or raise LaunchError saying
    whose folder refused it and why that happens. Through the link: in the image, runs/ links
    to /workspace/runs, which a fresh volume over /workspace (a new PVC) does not have yet, and
    mkdir stops at a dangling link."""
    real = Path(os.path.realpath(path))
    try:
        real.mkdir(parents=True, exist_ok=True)
        if not os.access(real, os.W_OK):
            raise PermissionError(13, "Permission denied", str(real))
    except PermissionError as e:
        owner = next(p for p in (real, *real.parents) if p.exists())
        stat = owner.stat()
        raise LaunchError(
            f"output_dir {path}: {e.strerror}: {owner} belongs to uid {stat.st_uid}, gid {stat.st_gid} "
            f"(mode {stat.st_mode & 0o777:o}) and this process runs as uid {os.getuid()}, gid {os.getgid()}. "
            "On Kubernetes the pod's fsGroup makes a volume writable only where its CSI driver applies it "
            "(fsGroupPolicy; many ReadWriteMany drivers do not): see k8s/README.md, "
            "\"Choose the storage class\"") from None
