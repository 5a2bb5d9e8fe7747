"""Hosts on one machine: Linux network namespaces joined by a bridge, for multi-node tests.

Each host is a network namespace with a veth into a private bridge, its own IP address, and
processes that see their own hostname and /etc/hosts (a private UTS and mount namespace per
process). So `node0`, or `job-master-0`, resolves inside every host exactly as cluster DNS
would resolve it, and gloo and the c10d store really cross a network.

Three choices that cost hours when made the other way:
- `nsenter --net=` rather than `ip netns exec`, which remounts /sys (slurmd dies of it).
- No default route and no address on the bridge: traffic stays between our namespaces, and
  glibc doesn't wait seconds on reverse lookups that go nowhere.
- `::ffff:IP` lines in the hosts file, because the TCPStore sees IPv4-mapped peers.

Everything started here is killed and every namespace and link deleted in `close()`, which
the fixtures call even when a test fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from support.processes import killpg, wait_all

PY_SPY = str(Path(sys.executable).with_name("py-spy"))  # the venv's, a dev dependency
SUBNET = "10.99.0"  # the bridge has no address, so this never meets the root namespace's routes
_created = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TornDown:
    """`with X() as x`: `_up()` on entry, `close()` on exit, and on an entry that failed
    halfway, so nothing half-started outlives a test."""

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Network(TornDown):
    """`hosts` maps each host's name to the extra names it answers to (Service DNS aliases).
    `rate_mbit`: each host's egress link rate (a token bucket on its eth0), or None for the
    veth's own speed, effectively unlimited. Only our namespaces' links are shaped."""

    def __init__(self, hosts: dict[str, list[str]], rate_mbit: float | None = None):
        self.aliases = dict(hosts)
        self.rate_mbit = rate_mbit
        # Unique per instance: a network closed a moment ago may still be deleting its links.
        tag = f"{os.getpid() % 10000}x{next(_created)}"
        self.bridge = f"tnb{tag}"
        self.namespaces = {name: f"tnet{tag}-{i}" for i, name in enumerate(self.aliases)}
        self.addresses = {name: f"{SUBNET}.{11 + i}" for i, name in enumerate(self.aliases)}
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // len(self.aliases))
        self.cpus = {name: ",".join(str(cores[(i * share + k) % len(cores)]) for k in range(share))
                     for i, name in enumerate(self.aliases)}
        self.workdir = Path(tempfile.mkdtemp(prefix="netns-"))
        self.hosts_file = self.workdir / "hosts"
        self.procs: list[subprocess.Popen] = []
        self.created_dirs: list[Path] = []

    def _up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for i, (name, ns) in enumerate(self.namespaces.items()):
            outside, inside = f"{self.bridge}v{i}", f"{self.bridge}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "link", "set", inside, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate_mbit is not None:
                self._shape(ns)
            names = " ".join([name, *self.aliases[name]])
            lines += [f"{self.addresses[name]} {names}", f"::ffff:{self.addresses[name]} {names}"]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.hosts_file.chmod(0o644)

    def _shape(self, ns: str) -> None:
        """tbf on the namespace's eth0: at most `rate_mbit` leaves the host. Its bucket holds
        10 ms of traffic (at least 64 KB, so that a full-size segment always fits); what
        waits longer than 200 ms is dropped, and TCP backs off as on a congested link."""
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_bytes / 100))
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms"],
                       check=True, capture_output=True, text=True)

    def shaped_bytes(self, host: str) -> int:
        """How many bytes `host`'s token bucket has let out so far."""
        shown = subprocess.run(["tc", "-n", self.namespaces[host], "-s", "qdisc", "show", "dev", "eth0"],
                               check=True, capture_output=True, text=True).stdout
        tbf = shown[shown.index("qdisc tbf"):]
        return int(tbf.split("Sent ", 1)[1].split()[0])

    def spawn(self, host: str, argv: list[str], env: dict[str, str], cwd: str | Path,
              binds: dict[str, Path] | None = None, log: Path | None = None) -> subprocess.Popen:
        """Start `argv` on `host`: its netns, hostname and hosts file, with `binds` mounted
        (path as `host` sees it -> folder on this machine), in `cwd`, output to `log`."""
        script = [f"hostname {shlex.quote(host)}", f"mount --bind {self.hosts_file} /etc/hosts"]
        for target, source in (binds or {}).items():
            self._mountpoint(Path(target), Path(source).is_dir())
            script.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
        script.append(f"cd {shlex.quote(str(cwd))}")
        # Each host gets its own core(s), as a container's cpuset would: two "nodes" sharing
        # every core would each start a thread per core and thrash.
        script.append(f'exec taskset -c {self.cpus[host]} "$@"')
        cmd = ["nsenter", f"--net=/run/netns/{self.namespaces[host]}",
               "unshare", "--uts", "--mount", "--propagation", "private",
               "sh", "-c", " && ".join(script), "sh", *argv]
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child writes it after we return)
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _mountpoint(self, path: Path, is_dir: bool) -> None:
        """Bind mounts need an existing target. Missing ones (say /workspace) are created
        empty on the host and removed in close()."""
        if path.exists():
            return
        missing = [p for p in [path, *path.parents] if not p.exists()]
        if is_dir:
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        self.created_dirs += missing

    def pids(self, host: str) -> list[str]:
        """Every process running on `host` now."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True)
        return listed.stdout.split()

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
        """Exit codes, or None for a process still running at the deadline (then every
        host's stacks are printed: pytest shows them with the failure)."""
        codes = wait_all(procs, timeout)
        if None in codes:
            print(self.stacks())
        return codes

    def stacks(self) -> str:
        """Where each Python process on every host is now: py-spy's dump of its threads,
        Python and native frames. A job that hangs says where, on every rank."""
        dumps = []
        for host in self.namespaces:
            for pid in self.pids(host):
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # gone, or py-spy stuck too
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if not Path(os.fsdecode(argv[0])).name.startswith("python"):
                        continue  # not an interpreter (wandb-core lives under site-packages)
                    for native in (["--native"], []):  # where it cannot unwind native frames, the Python ones
                        shown = subprocess.run([PY_SPY, "dump", *native, "--pid", pid], capture_output=True,
                                               text=True, timeout=30)
                        if shown.returncode == 0:
                            break
                    dumps.append(f"--- {host}: {b' '.join(argv).decode(errors='replace')[:200]}\n"
                                 f"{shown.stdout}{shown.stderr}")
        return "\n".join(dumps)

    def close(self) -> None:
        for proc in self.procs:
            killpg(proc.pid)
        for host in self.namespaces:  # anything that escaped its process group
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for i, ns in enumerate(self.namespaces.values()):
            # A namespace outlives its name while sockets of killed peers linger in it, and
            # its veth with it: delete our end, which deletes the pair.
            subprocess.run(["ip", "link", "del", f"{self.bridge}v{i}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for path in sorted(self.created_dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                path.unlink() if path.is_file() else path.rmdir()
        subprocess.run(["rm", "-rf", str(self.workdir)], check=False)
