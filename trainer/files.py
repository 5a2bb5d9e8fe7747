"""What a run writes is whole or absent: a file or folder is written under a temporary name,
flushed to the disk and renamed into place (`rename_into_place`), so a crash, a kill or a full disk
never leaves a torn one: a file is the previous version or the new one; a folder replaced is
the new one, the previous one, or (killed between the two renames) neither. Checkpoints, final/, summary.json,
metrics.jsonl's rewrite on resume, the pictures (curves.png, goodput.png) and score's chunks and shards
all go through it. And output_dir
itself: created through links, or refused in one line that says whose folder refused it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from trainer.errors import LaunchError


def fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` (a file, or a folder whose files are all written) to `final`, durably:
    every file is flushed first, and the rename then flushed into the parent folder. Without
    the first flush, a crash soon after the rename can leave `final` naming empty files. A
    `final` that exists is replaced; a folder is moved aside first, then removed."""
    for file in [tmp] if tmp.is_file() else sorted(f for f in tmp.rglob("*") if f.is_file()):
        fsync(file)
    stale = None
    if final.is_dir():
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
    os.replace(tmp, final)
    fsync(final.parent)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def write_text(path: Path, text: str) -> None:
    """`path` holds `text`, whole, or keeps what it held (rename_into_place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    rename_into_place(tmp, path)


def write_figure(fig, path: Path, dpi: int) -> None:
    """`path` holds matplotlib figure `fig` as a picture (of the format its suffix names),
    whole, or keeps what it held (rename_into_place): a kill or a full disk mid-write, or a failure of
    matplotlib's, leaves no torn picture for the card, push or a reader to take."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.removeprefix("."))
        rename_into_place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_jsonl(path: Path) -> list[dict]:
    """An append-only log's records, oldest first (none if it does not exist). A line cut
    short by a kill or a full disk mid-write is the only damage an append can leave: skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def fresh_folder(folder: Path) -> Path:
    """`folder`, created empty (a leftover of a failed attempt is removed first)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


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
