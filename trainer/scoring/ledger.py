"""The exactly-once ledger of a scoring run: `score.output/.score/`, on storage every worker
shares (a node's disk, NFS, Lustre, a PVC). Plain files, no server, no lock daemon.

- A chunk is **done** when its answers' file is in `chunks/SHARD/`. It is written aside and
  hard-linked into place, which fails where the file exists: a chunk is committed once,
  whoever else scored it, so no row is ever written twice. This alone makes the output
  exactly-once; the claims below only keep workers from scoring the same chunk twice.
- A chunk is **claimed** by the exclusive create of `claims/SHARD/N`, naming its worker. A
  claim is taken over when its worker is gone (`Lease.gone_because`): its heartbeat not
  renewed for score.lease_s, or its process on this node exited (at once: a `kill -9` on one
  node costs no wait). A worker restarted under its own name (the same job's rank, a new
  process) takes its claims back at once.
- A **worker** holds a lease on `workers/NAME/` (runtime/lease.py), renewed on a thread:
  its heartbeat. Its name is its job and rank where a launcher names a job (a Slurm job,
  requeued, keeps its id), else its host and process.
- `manifest.json` says what decides the answers (the model's files, the settings, the
  shards). A job whose manifest differs is refused in one line; one whose manifest is the
  same joins the work.
- `failed` holds the first worker's fatal error (a bad row, with score.bad_rows=stop): every
  other worker stops with it at its next chunk, whatever node it is on.
- `summaries/NAME.json`: each worker's counts, for `report`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer import errors, files
from trainer.errors import ConfigError, DataError
from trainer.exit_codes import Exit
from trainer.runtime import lease

log = logging.getLogger(__name__)

LEDGER = ".score"


def worker_name(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """This worker's name: its job and rank, which a restart of the job keeps (a requeued
    Slurm job, a Kubernetes index, torchrun's restart), else its host and process."""
    job = lease.job_of(environ)
    name = f"{job}-rank{rank}" if job else f"{socket.gethostname()}-pid{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


class Ledger:
    """One worker's view of the ledger in `output`."""

    def __init__(self, output: Path, name: str, lease_s: float, clock: Callable[[], float] = time.time):
        self.root = output / LEDGER
        self.name, self.lease_s, self.clock = name, lease_s, clock
        self.me = lease.this_process(clock())
        self._renewal: lease.Renewal | None = None
        self.committed_twice = 0
        """Chunks this worker scored that another had committed first (a claim taken over
        from a worker that was only slow)."""

    # --- the job ------------------------------------------------------------------------

    def join(self, manifest: dict) -> None:
        """Write the manifest, or check that this job's equals the one there: a different
        model or settings in one output folder would mix their answers."""
        path = self.root / "manifest.json"
        files.make_writable_dir(self.root)
        text = json.dumps(manifest, indent=1, sort_keys=True)
        manifest = json.loads(text)  # as read back: tuples become lists
        aside = self.root / f".manifest.{self.me.lease_id}.tmp"
        aside.write_text(text)
        try:
            os.link(aside, path)
        except FileExistsError:
            theirs = json.loads(path.read_text())
            differ = sorted(k for k in {*manifest, *theirs} if manifest.get(k) != theirs.get(k))
            if differ:
                raise ConfigError(f"score.output: {self.root.parent} holds another scoring job's output (it differs "
                                  f"in {', '.join(differ)}): give this job its own score.output") from None
        finally:
            aside.unlink(missing_ok=True)
        if failure := self.failure():  # a new job tries again: what stopped the last may be gone (a full disk)
            log.warning("score: the last job on %s stopped: %s; trying again", self.root.parent, failure)
            (self.root / "failed").unlink(missing_ok=True)

    def start_heartbeat(self) -> None:
        """Take this worker's lease (a live worker of the same name is refused) and renew it
        on a thread until `end()`."""
        folder = self.root / "workers" / self.name
        files.make_writable_dir(folder)
        held = lease.Lease(folder, self.lease_s, self.me, clock=self.clock, timeout_key="score.lease_s")
        if warning := held.acquire():
            log.warning("%s", warning)

        def lost(who: str) -> None:  # frozen for the whole lease: others are redoing our chunks
            errors.report(f"score: worker {self.name}: its lease was taken over by {who}: stopping")
            os._exit(Exit.USAGE)

        self._renewal = lease.Renewal(held, lease.renewal_period(self.lease_s / 4, self.lease_s), lost).start()

    def end(self) -> None:
        if self._renewal is not None:
            self._renewal.end()

    # --- chunks -------------------------------------------------------------------------

    def chunk_path(self, shard: str, index: int, suffix: str) -> Path:
        return self.root / "chunks" / shard / f"{index:08d}{suffix}"

    def done(self, shard: str, index: int, suffix: str) -> bool:
        return self.chunk_path(shard, index, suffix).exists()

    def committed(self, shard: str, suffix: str) -> int:
        """How many of the shard's chunks are committed (and not yet removed by its publication)."""
        return len(list((self.root / "chunks" / shard).glob(f"*{suffix}")))

    def claim(self, shard: str, index: int, suffix: str) -> bool:
        """Whether this worker may score the chunk now: it claimed it, or took over the claim
        of a worker that is gone (or of itself, restarted), and the chunk is not committed.
        (A commit removes its claim, so a worker whose list of chunks left is older than the
        commit would claim the chunk afresh: it looks once the claim is its own, when no other
        worker can commit the chunk any more.)"""
        try:
            if self._claim(shard, index):
                if not self.done(shard, index, suffix):
                    return True
                self.release(shard, index)
            return False
        except OSError as e:  # the ledger's storage, never to be read as the shard's (Reader.chunks)
            raise DataError(f"score.output: {self.root}: {errors.describe(e)}") from None

    def release(self, shard: str, index: int) -> None:
        path = self.root / "claims" / shard / f"{index:08d}"
        with contextlib.suppress(FileNotFoundError):
            if path.read_text() == f"{self.name} {self.me.lease_id}":
                path.unlink()

    def _claim(self, shard: str, index: int) -> bool:
        path = self.root / "claims" / shard / f"{index:08d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{self.me.lease_id}.tmp")
        mine = f"{self.name} {self.me.lease_id}"
        for _ in range(4):  # each turn decides, unless the claim changed under it
            aside.write_text(mine)
            try:
                os.link(aside, path)  # whole: a claim always names its worker
                return True
            except FileExistsError:
                pass
            finally:
                aside.unlink(missing_ok=True)
            try:
                holder = path.read_text()
            except FileNotFoundError:
                continue
            worker = holder.partition(" ")[0]
            if holder == mine or (worker != self.name and not self._gone(worker)):
                return False  # ours already (a chunk read ahead), or a live worker's
            # Moved aside under a name of our own, which only one taker's rename can do; if
            # what moved is not the claim judged gone (another taker's, made meanwhile), it
            # goes back, and that taker keeps the chunk.
            taken = path.with_name(f"{path.name}.taken-by-{self.name}")
            with contextlib.suppress(FileNotFoundError):
                path.rename(taken)
                if taken.read_text() != holder:
                    with contextlib.suppress(FileExistsError):
                        os.link(taken, path)
                    taken.unlink()
                    return False
                taken.unlink()
        return False

    def _gone(self, worker: str) -> bool:
        held = lease.Lease(self.root / "workers" / worker, self.lease_s, self.me, clock=self.clock)
        try:
            holder = held.read()
        except errors.LeaseHeld:
            return False
        return holder is None or held.gone_because(holder) is not None

    def commit(self, shard: str, index: int, suffix: str, write: Callable[[Path], None]) -> bool:
        """Write the chunk's answers aside with `write(path)`, then link them into place: False
        if another worker committed the chunk first (then ours are dropped)."""
        final = self.chunk_path(shard, index, suffix)
        aside = final.with_name(f".{final.name}.{self.me.lease_id}.tmp")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            write(aside)
            files.fsync(aside)
            os.link(aside, final)
        except FileExistsError:
            self.committed_twice += 1
            return False
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DataError(f"score.output: {final.parent}: the disk is full ({errors.describe(e)})") from None
            raise DataError(f"score.output: {final}: {errors.describe(e)}") from None
        finally:
            aside.unlink(missing_ok=True)
        (self.root / "claims" / shard / f"{index:08d}").unlink(missing_ok=True)
        return True

    def set_count(self, shard: str, chunks: int) -> None:
        """The shard's number of chunks, known once a worker has read to its end."""
        path = self.root / "chunks" / shard / "count"
        if not path.exists():  # several workers may reach the end at once: each writes its own aside
            path.parent.mkdir(parents=True, exist_ok=True)
            aside = path.with_name(f".count.{self.me.lease_id}.tmp")
            aside.write_text(str(chunks))
            files.rename_into_place(aside, path)

    def count(self, shard: str) -> int | None:
        try:
            return int((self.root / "chunks" / shard / "count").read_text())
        except FileNotFoundError:
            return None

    def missing(self, shard: str, suffix: str) -> list[int] | None:
        """The shard's chunks not yet done; None while its length is not known."""
        count = self.count(shard)
        if count is None:
            return None
        return [i for i in range(count) if not self.done(shard, i, suffix)]

    def remove_chunks(self, shard: str) -> None:
        """A published shard's chunks and claims; its count stays, for the progress lines."""
        for path in [*(self.root / "chunks" / shard).glob("*[0-9].*"), *(self.root / "claims" / shard).glob("*")]:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (self.root / "claims" / shard).rmdir()

    # --- shards that cannot be read (score.bad_rows=skip) -----------------------------------

    def skip_shard(self, shard: str, why: str) -> None:
        """No worker scores `shard` any more: the first reason wins. Its committed chunks stay
        in the ledger, and no output shard is written for it."""
        folder = self.root / "skipped"
        folder.mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError):
            fd = os.open(folder / shard.replace("/", "%2F"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(why)
        for claim in (self.root / "claims" / shard).glob("[0-9]*"):
            self.release(shard, int(claim.name))

    def skipped(self, shard: str) -> str | None:
        try:
            return (self.root / "skipped" / shard.replace("/", "%2F")).read_text()
        except FileNotFoundError:
            return None

    # --- failure --------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Every worker's stop: the first message wins."""
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.root / "failed", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(message)

    def failure(self) -> str | None:
        try:
            return (self.root / "failed").read_text() or None
        except FileNotFoundError:
            return None

    def write_summary(self, summary: dict) -> None:
        (self.root / "summaries").mkdir(exist_ok=True)
        files.write_text(self.root / "summaries" / f"{self.name}.json", json.dumps(summary, indent=1) + "\n")
