"""One job per output_dir: a lease, `output_dir/lease.json`, that rank 0 takes before anything
else is written there and before the resume picks a checkpoint, renews every heartbeat, and
removes at the end.

Two jobs on one output_dir (a double sbatch, a job started again while the old one runs) would
otherwise resume from each other's checkpoints and write the same step-N folders, and both
exit 0. The lease names its holder (host, pid, job, start); a second job is refused in one
line naming it. A lease is taken over, with a warning, when its holder is gone: not renewed for
`fault.lease_timeout_s`; or held by this same job (the same Slurm job requeued, torchrun's
restart of its workers, the same TRAINER_JOB_ID); or by a process of this host and pid
namespace that no longer exists.

Shared storage (NFS and the like) is the case this is for, so no `flock`, which many NFS
setups don't carry between clients: a lease is created whole by a hard link of a file
written aside (atomic on NFS; O_CREAT|O_EXCL where links are not supported), and a holder
re-reads it to confirm. A take-over is decided by the exclusive create of a marker named
after the stale lease's id, so of two jobs taking over one stale lease one wins, and a job
that judged a lease stale long ago finds its id gone and backs off. A holder whose lease was
taken over (it stopped renewing for the whole timeout: a frozen node) learns it at its next
renewal and stops (`Renewal`'s `on_lost`).

The standard library and the trainer's leaves alone, nothing of torch: its tests run in a blink.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer import errors, files
from trainer.config.schema import FaultConfig
from trainer.errors import LeaseHeld
from trainer.exit_codes import Exit

__all__ = ["FILE", "Holder", "Lease", "LeaseHeld", "Renewal"]

log = logging.getLogger(__name__)

FILE = "lease.json"


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as written in the file."""

    lease_id: str
    host: str
    pid: int
    pid_ns: str | None
    """This process's pid namespace (/proc/self/ns/pid): a pid means something only in it."""
    job: str | None
    """The launcher's job, which a restart of the job keeps (`job_of`): `slurm job 123`,
    `torchrun run ID`, `kubernetes job at HOST:PORT`, `job ID`; None when nothing names one."""
    started: float
    renewed: float
    """Unix times, on the holder's clock."""

    def describe(self, now: float) -> str:
        job = f", {self.job}" if self.job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return (f"host {self.host}, pid {self.pid}{job}, started {started}, renewed {now - self.renewed:.0f}s ago "
                f"(lease {self.lease_id})")


def job_of(environ: Mapping[str, str]) -> str | None:
    """The job a restart keeps: TRAINER_JOB_ID (any launcher), else Slurm's job id (kept by a
    requeue), else torchrun's run id (kept across its restarts of the workers; "none", its
    default without a rendezvous id, names nothing), else on Kubernetes the rendezvous the
    operator gives every pod of the job: a Service named after the job (PyTorchJob:
    PET_RDZV_ENDPOINT, `NAME-worker-0:PORT`; TrainJob: PET_MASTER_ADDR), one live job per name,
    the same for the pods it recreates; or, for a pod of an Indexed Job (one live pod per
    completion index), the job and that index: its host name is JOB-INDEX, the same for the pod
    recreated for the index, whose pid namespace may give the dead one's pid back to another
    process, so that only the job can say it is the same worker."""
    if job := environ.get("TRAINER_JOB_ID"):
        return f"job {job}"
    if job := environ.get("SLURM_JOB_ID"):
        cluster = environ.get("SLURM_CLUSTER_NAME")
        return f"slurm job {job}" + (f" on {cluster}" if cluster else "")
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun run {run_id}"
    if "KUBERNETES_SERVICE_HOST" not in environ:
        return None
    if rendezvous := environ.get("PET_RDZV_ENDPOINT") or environ.get("PET_MASTER_ADDR"):
        return f"kubernetes job at {rendezvous}"
    if index := environ.get("JOB_COMPLETION_INDEX"):
        job = environ.get("HOSTNAME", socket.gethostname()).removesuffix(f"-{index}")
        return f"kubernetes indexed job {job} index {index}"
    return None


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process(now: float, environ: Mapping[str, str] = os.environ) -> Holder:
    return Holder(lease_id=secrets.token_hex(8), host=socket.gethostname(), pid=os.getpid(), pid_ns=pid_namespace(),
                  job=job_of(environ), started=now, renewed=now)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class Lease:
    """output_dir's lease, as the process `me` would hold it. `clock` (Unix time) and
    `alive` (is a pid of this host running) are the tests' to replace."""

    def __init__(self, output_dir: Path, timeout_s: float, me: Holder, clock: Callable[[], float] = time.time,
                 alive: Callable[[int], bool] = pid_alive, environ: Mapping[str, str] = os.environ,
                 timeout_key: str = "fault.lease_timeout_s"):
        self.folder = Path(output_dir)
        self.path = self.folder / FILE
        self.timeout_s, self.timeout_key = timeout_s, timeout_key
        self.me = me
        self.clock = clock
        self.alive = alive
        self.in_kubernetes = "KUBERNETES_SERVICE_HOST" in environ

    # --- reading ------------------------------------------------------------------

    def read(self, path: Path | None = None) -> Holder | None:
        """The holder written in the lease (or a marker), None if there is none. A file that
        is not a lease is refused: it is not ours to remove."""
        path = path or self.path
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return Holder(**json.loads(text))
        except (ValueError, TypeError):
            raise LeaseHeld(f"output_dir {self.folder}: {path} is not a lease this trainer wrote; if no job uses "
                            f"this output_dir, delete it") from None

    def stale_because(self, holder: Holder) -> str | None:
        """Why `holder`'s lease may be taken over now, or None: it holds the folder."""
        if holder.job is not None and holder.job == self.me.job:
            return f"held by this same {holder.job}, restarted"
        return self.gone_because(holder)

    def gone_because(self, holder: Holder) -> str | None:
        """Why `holder` is surely gone, or None: not renewed for the timeout, or its process
        on this host has exited."""
        now = self.clock()
        if now - holder.renewed > self.timeout_s:
            return f"not renewed for {now - holder.renewed:.0f}s ({self.timeout_key}={self.timeout_s:g})"
        if holder.host == self.me.host:
            if holder.pid_ns == self.me.pid_ns and holder.pid_ns is not None:
                if holder.pid == self.me.pid or not self.alive(holder.pid):
                    return f"its process {holder.pid} on this host is gone"
            elif self.in_kubernetes:
                # A pod's name is its hostname, one live pod per name: another pid namespace
                # under it is this pod's previous container, which has exited.
                return "held by this pod's previous container"
        return None

    # --- taking it ------------------------------------------------------------------

    def acquire(self) -> str | None:
        """Take the lease, or raise LeaseHeld naming its holder. Returns the warning to log
        when a lease was taken over, else None."""
        for _ in range(8):  # each turn ends in a decision unless the file changed under it
            if self._create(self.path, self.me):
                self._confirm()
                return None
            holder = self.read()
            if holder is None:  # released between the two looks
                continue
            why = self.stale_because(holder)
            if why is None:
                raise self.refusal(holder)
            if self._take_over(holder):
                return (f"output_dir {self.folder}: took over the lease of {holder.describe(self.clock())}: {why}")
        raise LeaseHeld(f"output_dir {self.folder}: {self.path} kept changing while this job tried to take it: "
                        "another job is starting on this output_dir; give each job its own output_dir")

    def refusal(self, holder: Holder, taking_over: bool = False) -> LeaseHeld:
        what = "is being taken over by" if taking_over else "is in use by"
        return LeaseHeld(
            f"output_dir {self.folder} {what} another job ({holder.describe(self.clock())}): wait for it to end, "
            f"give this job another output_dir, or, if that job is surely dead, delete {self.path} (a lease not "
            f"renewed for fault.lease_timeout_s={self.timeout_s:g}s is taken over)")

    def _take_over(self, stale: Holder) -> bool:
        """Replace the lease `stale` with ours, if this process is the one to: the exclusive
        create of a marker named after its id decides among takers. False: the lease changed
        meanwhile (taken over by another, renewed by its holder, released); look again."""
        for generation in range(8):
            marker = self.folder / f".{FILE}.takeover-{stale.lease_id}.{generation}"
            if self._create(marker, self.me):
                break
            taker = self.read(marker)
            if taker is None:  # the winner has finished, and removed it
                return False
            if self.clock() - taker.renewed <= self.timeout_s:
                if self.read() != stale:  # a late taker's marker, which will back off: look again
                    return False
                raise self.refusal(taker, taking_over=True)
            # A taker that died holding its marker: the next generation's create decides anew.
        else:
            raise LeaseHeld(f"output_dir {self.folder}: too many stale take-over markers .{FILE}.takeover-* "
                            "beside the lease: if no job uses this output_dir, delete them and the lease")
        try:
            if self.read() != stale:  # taken over before us, renewed, or released: not what we judged
                return False
            self._write(self.path, self.me)
            self._confirm()
            return True
        finally:
            for old in self.folder.glob(f".{FILE}.takeover-{stale.lease_id}.*"):
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()

    def _confirm(self) -> None:
        holder = self.read()
        if holder is None or holder.lease_id != self.me.lease_id:
            if holder is None:
                raise LeaseHeld(f"output_dir {self.folder}: {self.path} vanished as this job took it: another job "
                                "is using this output_dir; give each job its own output_dir")
            raise self.refusal(holder)

    # --- holding it -------------------------------------------------------------------

    def renew(self) -> str | None:
        """Write a new renewal time. Returns None, or who has the lease now: this job must
        stop writing to output_dir."""
        holder = self.read()
        if holder is None:  # deleted by hand, as the refusal offers: still ours if no one took it since
            self.me = Holder(**{**asdict(self.me), "renewed": self.clock()})
            if self._create(self.path, self.me):
                log.warning("output_dir %s: %s was deleted while this job held it: written again", self.folder,
                            self.path)
                return None
            holder = self.read()
        if holder is None:
            return f"nobody: {self.path} keeps vanishing"
        if holder.lease_id != self.me.lease_id:
            return f"another job ({holder.describe(self.clock())})"
        self.me = Holder(**{**asdict(self.me), "renewed": self.clock()})
        self._write(self.path, self.me)
        return None

    def release(self, folder_too: bool = False) -> None:
        """Remove the lease, if it is still ours; and with `folder_too`, output_dir if that
        leaves it empty (a run that failed before writing anything leaves nothing)."""
        with contextlib.suppress(LeaseHeld):
            holder = self.read()
            if holder is not None and holder.lease_id == self.me.lease_id:
                self.path.unlink(missing_ok=True)
                if folder_too:
                    with contextlib.suppress(OSError):
                        self.folder.rmdir()

    # --- files ------------------------------------------------------------------------

    def _aside(self, holder: Holder) -> Path:
        tmp = self.folder / f".{FILE}.{self.me.lease_id}.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(asdict(holder)))
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _create(self, path: Path, holder: Holder) -> bool:
        """Create `path` holding `holder`, whole, if it does not exist: True if this call did."""
        tmp = self._aside(holder)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            # NFS: a link whose reply was lost is retried, and answers EEXIST for our own.
            return os.stat(tmp).st_nlink == 2
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            return self._create_exclusive(path, holder)  # a file system without hard links
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _create_exclusive(path: Path, holder: Holder) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(asdict(holder)))
        return True

    def _write(self, path: Path, holder: Holder) -> None:
        os.replace(self._aside(holder), path)  # whole: a reader sees the old lease or the new


class Renewal:
    """The holder's heartbeat on its lease: a renewal every `period_s` on a thread of its
    own, from the moment the lease is taken (loading the data and the model can take minutes
    before the first step) to `stop()`. A renewal that finds the lease taken over calls
    `on_lost(who)` (who has it now, in words) and ends."""

    def __init__(self, lease: Lease, period_s: float, on_lost: Callable[[str], None], created_folder: bool = False):
        self.lease, self.period_s, self.on_lost = lease, period_s, on_lost
        self.created_folder = created_folder
        """Whether taking the lease created output_dir: `end()` removes it if still empty."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-lease", daemon=True)

    def start(self) -> Renewal:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                taker = self.lease.renew()
            except Exception as e:  # storage that fails now may answer next time  # noqa: BLE001
                log.warning("output_dir lease %s: renewal failed: %s", self.lease.path, e)
                continue
            if taker is not None:
                self.on_lost(taker)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def end(self) -> None:
        """The job's end, whatever it was: no more renewals, and the lease released."""
        self.stop()
        self.lease.release(folder_too=self.created_folder)


def renewal_period(heartbeat_s: float, timeout_s: float) -> float:
    """The heartbeat, or often enough that a lease is renewed several times per timeout."""
    return min(heartbeat_s, timeout_s / 4)


def hold(output_dir: Path, fault_cfg: FaultConfig) -> Renewal:
    """This job's lease on `output_dir` (created first), renewed every heartbeat until `end()`;
    a lease taken over from a dead holder is logged as a warning. Where the lease is lost (this
    job was silent for the whole timeout: a frozen node), another job writes output_dir now,
    and every further write of ours would clobber its files: the process stops at once."""
    created = not output_dir.exists()
    files.make_writable_dir(output_dir)
    held = Lease(output_dir, fault_cfg.lease_timeout_s, this_process(time.time()))
    if warning := held.acquire():
        logging.getLogger("trainer").warning("%s", warning)  # the job's own line, as the CLI's

    def lost(who: str) -> None:
        errors.report(f"output_dir {output_dir}: this job's lease was taken over by {who}: stopping; "
                      "resume the run with one job at a time")
        os._exit(Exit.USAGE)

    return Renewal(held, renewal_period(fault_cfg.heartbeat_s, fault_cfg.lease_timeout_s), lost, created).start()
