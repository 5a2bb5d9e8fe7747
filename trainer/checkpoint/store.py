"""A run's checkpoints on disk: `output_dir/checkpoints/step-N/` folders that are either
complete and verified, or ignored.

A checkpoint is written into a temporary folder, checksummed into its completion marker
(`COMPLETE`, written last) and published by rename (trainer/files.py), so a crash or a full
disk mid-save leaves the previous checkpoints untouched. A folder without a marker, or whose
files don't match the marker's checksums, is not a checkpoint: `verify` says why, and a
resume skips it. Pruning never removes the checkpoint just written, nor the best one.

What the files hold is the format's (trainer/checkpoint/formats.py) and the Checkpointer's
(trainer/checkpoint/checkpointer.py); this module only knows them as files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from trainer import files
from trainer.checkpoint import formats

log = logging.getLogger(__name__)

MARKER = "COMPLETE"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_state(path: Path) -> dict:
    """A checkpoint's state.json (its step, data position, world size, global batch, ...)."""
    return json.loads((path / "state.json").read_text())


def verify(path: Path) -> str | None:
    """None if `path` is a complete checkpoint whose files match its marker, else why not."""
    marker = path / MARKER
    if not marker.is_file():
        return "no completion marker (the save did not finish)"
    try:
        expected = json.loads(marker.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable completion marker"
    # A sharded checkpoint's marker names every shard besides the format's required files.
    for name in sorted(set(formats.of_checkpoint(path).required) | set(expected)):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256(file) != expected.get(name):
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


class Store:
    """The step-N folders under `root` (output_dir/checkpoints)."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def temporary(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before it is published: one folder every
        rank writes into (shards, per-rank states), made empty by rank 0."""
        return self.root / f".tmp-step-{step}"

    def step_dirs(self) -> list[Path]:
        """step-N folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
        return sorted(found, key=step_of, reverse=True)

    def newest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; each one skipped on the way is logged."""
        for path in self.step_dirs():
            problem = verify(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def complete(self, step: int, tmp: Path, write_files: Callable[[Path], None]) -> Path:
        """`write_files(tmp)` (tmp exists and may hold files already: shards), then the marker
        with every file's checksum, then `tmp` renamed to step-N. A failure removes `tmp` and
        leaves every published checkpoint as it was."""
        final = self.folder(step)
        try:
            write_files(tmp)
            checksums = {file.relative_to(tmp).as_posix(): sha256(file)
                         for file in sorted(f for f in tmp.rglob("*") if f.is_file())}
            (tmp / MARKER).write_text(json.dumps({"step": step, "sha256": checksums}, indent=2))
            # A leftover from an earlier attempt at this step (corrupt, say) is replaced.
            files.rename_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def prune(self, step: int, keep: int, keep_also: int | None) -> None:
        """Keep the checkpoint just written and the newest `keep - 1` complete ones before it,
        and `keep_also`'s.

        Folders from later steps belong to a timeline this run left behind: corrupt ones that
        resume skipped, or ones past a checkpoint the user chose to resume from. Counting them
        could delete the only good checkpoint, and `resume: auto` would pick them up later, so
        they are moved aside (not deleted) where resume doesn't look.
        """
        for later in [p for p in self.step_dirs() if step_of(p) > step]:
            aside = self.root / f"abandoned-{later.name}-{int(time.time())}"
            later.rename(aside)
            log.warning("moved %s aside to %s: this run resumed from an earlier step", later, aside.name)
        complete = [p for p in self.step_dirs() if (p / MARKER).is_file()]
        for old in complete[keep:]:
            if step_of(old) != keep_also:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)
