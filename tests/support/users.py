"""Run commands as an unprivileged user, as the image runs its processes (uid 1000).

Root ignores file permissions, so a permission bug only shows as another user. This
machine's Python lives under /root (mode 0700), which another user cannot enter: in the
command's own mount namespace, /root is covered by an empty tmpfs that shows nothing but
the Python installation, bound back at its own path. Nothing changes outside the command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

UID = 1000  # the image's user (Dockerfile)


def become(uid: int, scratch: Path) -> list[str]:
    """Shell steps, to run as root in a private mount namespace, after which `exec "$@"`
    runs as `uid`, able to start this Python. `scratch`: an empty folder for one mount."""
    steps = []
    prefix = Path(sys.base_prefix).resolve()
    if prefix.is_relative_to("/root"):
        scratch.mkdir(parents=True, exist_ok=True)
        keep = shlex.quote(str(scratch))
        steps = [f"mount --bind {shlex.quote(str(prefix))} {keep}",
                 "mount -t tmpfs -o mode=0755 tmpfs /root",
                 f"mkdir -p {shlex.quote(str(prefix))}",
                 f"mount --bind {keep} {shlex.quote(str(prefix))}"]
    return [*steps, f'exec setpriv --reuid={uid} --regid={uid} --clear-groups "$@"']


def as_user(argv: list[str], scratch: Path, uid: int = UID) -> list[str]:
    """`argv` as `uid`, in a private mount namespace."""
    return ["unshare", "--mount", "--propagation", "private",
            "sh", "-c", " && ".join(become(uid, scratch)), "sh", *argv]
