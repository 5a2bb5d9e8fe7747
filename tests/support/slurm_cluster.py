"""A real Slurm cluster on one machine: munged, slurmctld and two slurmd compute nodes.

Debian's slurm-wlm and munge, no systemd, no cgroups, all state in a temporary folder.
Every daemon runs in the foreground under our control, on a host of tests/support/netns.py: the
controller on `ctl`, each slurmd on its own `nodeN` with its own IP address, hostname and
/etc/hosts, so a job's processes inherit all three and its traffic really crosses a network.
Clients (sbatch, scontrol, submitit) run in `ctl`'s network namespace, as on a login node.

Settings that keep the suite fast, each worth minutes:
- `cred_expire=10` and `sched_interval=2`: a requeued job runs again after ~11 s, not 147 s.
- `config_overrides`: nodes advertise the CPUs we configure, whatever the machine has.
- Fake GPUs: character devices with NVIDIA's major number (195) back a `gpu` GRES, so
  `--gpus-per-node` is scheduled and CUDA_VISIBLE_DEVICES set exactly as on a GPU node.
  No driver is behind them, so torch sees no CUDA and the trainer uses gloo.
- No accounting daemon: job state comes from `scontrol show job` (MinJobAge keeps it).

The nodes are small in CPUs (4) but have the GPUs slurm/ddp.sh's defaults ask for (8), so a
plain `sbatch slurm/ddp.sh` must run on them. Two partitions over the same nodes: `debug`
(the default, no time limit) and `short`, whose MaxTime is below ddp.sh's default --time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from support.netns import Network, TornDown
from support.processes import killpg, wait_for

NODES = ("node1", "node2")
CPUS_PER_NODE = 4
GPUS_PER_NODE = 8
SHORT_MAX_TIME = "30:00"
"""The `short` partition's MaxTime, as sinfo prints it."""
CTL_PORT = 16817


class SlurmCluster(TornDown):
    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="slurm-"))
        self.base.chmod(0o755)  # munged wants every folder above its socket searchable by all
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.sock"
        self.net = Network({"ctl": [], **{node: [] for node in NODES}})
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged: subprocess.Popen | None = None

    def _up(self) -> None:
        for folder in ("state", "spool", "log", "run", "munge", "dev"):
            (self.base / folder).mkdir()
        self.net.__enter__()
        self._write_conf()
        self._start_munge()
        self.net.spawn("ctl", ["slurmctld", "-D"], self.env, self.base, log=self.base / "log" / "ctl.out")
        wait_for(lambda: "UP" in self.client(["scontrol", "ping"], check=False).stdout, 20, "slurmctld")
        for node in NODES:
            self.net.spawn(node, ["slurmd", "-D", "-N", node], self.env, self.base,
                           log=self.base / "log" / f"{node}.out")
        # One partition's view: sinfo -N lists a node once per partition it is in.
        states = ["sinfo", "-h", "-N", "-p", "debug", "-o", "%t"]
        wait_for(lambda: self.client(states).stdout.split() == ["idle"] * len(NODES), 30, "both nodes idle")

    def _write_conf(self) -> None:
        ctl_addr = self.net.addresses["ctl"]
        nodes = "\n".join(
            f"NodeName={node} NodeAddr={self.net.addresses[node]} CPUs={CPUS_PER_NODE} RealMemory=4000 "
            f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN" for node in NODES)
        self.conf.write_text(f"""\
ClusterName=test
SlurmctldHost=ctl({ctl_addr})
SlurmctldPort={CTL_PORT}
SlurmdPort={CTL_PORT + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={self.base}/state
SlurmdSpoolDir={self.base}/spool/%n
SlurmctldPidFile={self.base}/run/slurmctld.pid
SlurmdPidFile={self.base}/run/slurmd-%n.pid
SlurmctldLogFile={self.base}/log/slurmctld.log
SlurmdLogFile={self.base}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
KillWait=10
MinJobAge=600
JobCompType=jobcomp/filetxt
JobCompLoc={self.base}/log/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=short Nodes={",".join(NODES)} MaxTime={SHORT_MAX_TIME} State=UP OverSubscribe=NO
""")
        for index in range(GPUS_PER_NODE):
            os.mknod(self.base / "dev" / f"nvidia{index}", 0o666 | stat.S_IFCHR, os.makedev(195, index))
        (self.base / "gres.conf").write_text(f"Name=gpu File={self.base}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")

    def _start_munge(self) -> None:
        folder = self.munge_socket.parent
        folder.chmod(0o755)  # munged refuses a socket folder others can write to
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._munged = subprocess.Popen(
            ["munged", "--foreground", "-S", str(self.munge_socket), f"--key-file={key}",
             f"--log-file={self.base}/log/munged.log", f"--pid-file={self.base}/run/munged.pid",
             f"--seed-file={folder}/munged.seed", "--num-threads=4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.munge_socket.exists, 10, "munged")

    def _on_login_host(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.net.namespaces['ctl']}", *argv]

    def client(self, argv: list[str], check: bool = True, env: dict[str, str] | None = None,
               cwd: Path | str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client (or anything that calls one) on the login host `ctl`."""
        done = subprocess.run(self._on_login_host(argv), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def popen(self, argv: list[str], env: dict[str, str], cwd: Path | str, log: Path) -> subprocess.Popen:
        """Start a long-running client on `ctl`; it is killed in close() if still running."""
        proc = subprocess.Popen(self._on_login_host(argv), env={**self.env, **env}, cwd=cwd, stdout=open(log, "w"),  # noqa: SIM115 (the client writes it after we return)
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.net.procs.append(proc)
        return proc

    def sbatch(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | str | None = None) -> str:
        done = self.client(["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict: JobState, ExitCode, Restarts, NodeList, ..."""
        shown = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def wait_job(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                              "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        """Poll until the job reaches one of `states`; its scontrol record then."""
        last: dict[str, str] = {}

        def settled() -> dict[str, str] | None:
            last.update(self.job(job_id))
            return dict(last) if last.get("JobState") in states else None

        try:
            return wait_for(settled, timeout, lambda: f"job {job_id} to end: still {last.get('JobState')}, "
                                                      f"reason {last.get('Reason')}", interval=0.5)
        except AssertionError:
            print(self.net.stacks())  # where the job's ranks are stuck, shown with the failure
            raise

    def close(self) -> None:
        # Cancel jobs while the controller lives, then kill whatever is left on every host:
        # daemons, slurmstepd and job processes all live in the hosts' network namespaces.
        with contextlib.suppress(Exception):
            self.client(["scancel", "--full", "--user=root"], check=False, timeout=10)
        self.net.close()
        if self._munged is not None:
            killpg(self._munged.pid)
            self._munged.wait(timeout=10)
        shutil.rmtree(self.base, ignore_errors=True)

    def logs(self) -> str:
        """The daemons' logs' tails, for a failing test's message."""
        tails = []
        for log in sorted((self.base / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"== {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)
