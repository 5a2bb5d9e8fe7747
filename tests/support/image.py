"""Our image, built from the real Dockerfile and run for real, with no daemon: buildah builds
it, podman runs it (runc), podman-compose runs the compose file. Every image test uses this.

Where no registry is reachable the CUDA base cannot be pulled, so the image is built FROM a
CPU base made here (`--build-arg BASE_IMAGE`): Debian bookworm minbase (Python 3.11, as the
lock) with a venv on PATH that holds the torch==2.13.0 wheel this machine's pip installs.
Every wheel comes from a wheelhouse that this machine's pip fills from the lock (its indexes,
find-links and proxy, so no HTTPS is needed inside a build); the base's pip reads only that.
The base and the wheelhouse are cached per machine, keyed by the lock; the app image is built
once per test run (its dependency layer is cached like the base, as `docker build` would).

podman is set up by files under a folder of the run's own (CONTAINERS_CONF,
CONTAINERS_STORAGE_CONF): runc, not crun (crun fails on this kernel's hybrid cgroups),
default ulimits root can grant here, and no network unless asked for: a container joins a
network namespace tests/support/netns.py made (`--network ns:`), never a podman bridge, which would
add firewall rules to the host. Only the image store outlives a run; containers, volumes,
podman's run state, cgroups and the builds' blob info cache (in /var/lib/containers, unless that was
there before) are removed when it ends, and containers a killed run left, at the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TRAINER_TEST_CACHE", "/var/tmp/ddp-trainer-tests"))
STATE = CACHE / "state"
BASE_RECIPE = Path(__file__).with_name("cpu-base.Containerfile")
APP_TAG = "localhost/ddp-trainer-test:latest"
TOOLS = {"buildah": "apt-get install buildah", "podman": "apt-get install podman", "runc": "apt-get install runc",
         "debootstrap": "apt-get install debootstrap",
         "podman-compose": "pip install podman-compose (requirements.lock)"}


def dockerfile_env() -> dict[str, str]:
    """The Dockerfile's ENV, read without building (the Slurm container jobs mount a
    workspace where the image points its caches)."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    return dict(item.split("=", 1) for line in text.splitlines() if line.startswith("ENV ")
                for item in shlex.split(line[4:]))


def dockerfile_run(containing: str) -> str:
    """The shell script of the Dockerfile's one RUN instruction that contains `containing`,
    as the builder hands it to `sh -c`."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (script,) = [line[4:] for line in text.splitlines() if line.startswith("RUN ") and containing in line]
    return script


def missing_tools() -> list[str]:
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    return [f"{tool} ({how})" for tool, how in TOOLS.items() if not shutil.which(tool, path=path)]


def lock_key() -> str:
    """The base and wheelhouse are valid for one lock and one base recipe."""
    digest = hashlib.sha256((REPO / "requirements.lock").read_bytes() + BASE_RECIPE.read_bytes())
    return digest.hexdigest()[:16]


class Engine:
    """podman and buildah with this run's configuration files, in `run_dir`. The image store
    is CACHE/storage, and podman's run state is CACHE/state, at the same paths in every run:
    podman's database (in the store) holds on to the paths it was first given. Runs use them
    one at a time (a lock: two runs would each remove what they take for the other's leftovers)."""

    BLOB_INFO_CACHE = Path("/var/lib/containers")
    """Where builds keep their blob info cache, whatever the storage config says."""

    def __init__(self, run_dir: Path, blob_info_cache_existed: bool = True):
        self.run_dir = run_dir
        self.blob_info_cache_existed = blob_info_cache_existed
        """False: close() removes BLOB_INFO_CACHE, which this run's builds made."""
        self.env = {**os.environ, "CONTAINERS_CONF": str(run_dir / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(run_dir / "storage.conf"),
                    "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}

    @classmethod
    def create(cls) -> Engine:
        CACHE.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="trainer-podman-"))
        engine = cls(run_dir, cls.BLOB_INFO_CACHE.exists())
        (run_dir / "containers.conf").write_text(f"""\
[containers]
# root may not raise its limits above the host's here (podman's default asks for more)
default_ulimits = ["nofile=16384:16384", "nproc=32768:32768"]
netns = "none"

[network]
# CNI's lock and any network config here, not in /etc/cni/net.d (no container gets a CNI network)
network_config_dir = "{STATE}/cni"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{STATE}/events.log"
tmp_dir = "{STATE}/libpod"
volume_path = "{STATE}/volumes"
""")
        (run_dir / "storage.conf").write_text(f"""\
[storage]
driver = "overlay"
graphroot = "{CACHE}/storage"
runroot = "{STATE}/storage"
""")
        return engine

    def lock(self) -> None:
        """Held until this process exits: one test run at a time uses the store."""
        self._lock = open(CACHE / "lock", "w")  # noqa: SIM115 (the lock is this open file, held to exit)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def __call__(self, *args: str, tool: str = "podman", check: bool = True,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run([tool, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return result

    def remove_containers(self) -> None:
        """Every container and volume in the store: while the lock is held, all are ours."""
        self("rm", "--all", "--force", "--time=0", check=False)
        self("volume", "rm", "--all", "--force", check=False)
        self("rm", "--all", "--force", tool="buildah", check=False)

    def close(self) -> None:
        self.remove_containers()
        subprocess.run(["umount", "-R", str(STATE / "storage")], capture_output=True)
        shutil.rmtree(STATE, ignore_errors=True)  # to podman, as after a reboot
        if not self.blob_info_cache_existed:  # ours: this machine had no podman state before
            shutil.rmtree(self.BLOB_INFO_CACHE, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        _remove_empty_cgroups()


def _remove_empty_cgroups() -> None:
    """podman's cgroupfs manager leaves libpod_parent (and its emptied children) in every
    hierarchy; a cgroup still holding a process stays."""
    for parent in Path("/sys/fs/cgroup").glob("*/libpod_parent"):
        for path in [*sorted(parent.rglob("*/"), key=lambda p: len(p.parts), reverse=True), parent]:
            with contextlib.suppress(OSError):
                path.rmdir()


# ---------------------------------------------------------------------------- build


def wheelhouse(key: str, log) -> Path:
    """Every wheel `pip install -c requirements.lock .` needs (and setuptools, to build the
    project), fetched by this machine's pip as it would install them."""
    wheels = CACHE / f"wheels-{key}"
    if not wheels.exists():
        partial = Path(tempfile.mkdtemp(dir=CACHE, prefix="wheels-partial-"))
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
              "-c", str(REPO / "requirements.lock"), "-d", str(partial), str(REPO), "setuptools", "wheel"], log)
        partial.rename(wheels)
    return wheels


def build_base(engine: Engine, log) -> str:
    """The CPU base, built once per machine and lock."""
    key = lock_key()
    base = f"localhost/ddp-trainer-test-base:{key}"
    if engine("image", "exists", base, check=False).returncode == 0:
        return base
    wheels = wheelhouse(key, log)
    os_image = f"localhost/ddp-trainer-test-os:{key}"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm", str(rootfs),
              "http://deb.debian.org/debian"], log)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run(["podman", "import", "-", os_image], log, env=engine.env, stdin=tar.stdout)
        assert tar.wait() == 0
    _run(["buildah", "bud", "--isolation=chroot", "--network=host", "--layers",
          "--build-arg", f"OS_IMAGE={os_image}", "-v", f"{wheels}:/wheels:ro",
          "-f", str(BASE_RECIPE), "-t", base, str(BASE_RECIPE.parent)], log, env=engine.env)
    engine("rmi", os_image, check=False)
    _forget_other_locks(engine, key)
    return base


def _forget_other_locks(engine: Engine, key: str) -> None:
    """A new lock's base replaces the old one's, and its wheelhouse too."""
    for line in engine("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split():
        if line.startswith("localhost/ddp-trainer-test-base:") and not line.endswith(key):
            engine("rmi", "--force", line, check=False)
    for wheels in CACHE.glob("wheels-*"):
        if wheels.name != f"wheels-{key}":
            shutil.rmtree(wheels, ignore_errors=True)


def build_app(engine: Engine, log) -> str:
    """Our Dockerfile and build context as they are (the builder applies .dockerignore) on
    the CPU base; returns the image's ID."""
    base = build_base(engine, log)
    wheels = wheelhouse(lock_key(), log)
    _run(["buildah", "bud", "--isolation=chroot", "--network=host", "--layers",
          "--build-arg", f"BASE_IMAGE={base}", "-v", f"{wheels}:/wheels:ro",
          "-t", APP_TAG, str(REPO)], log, env=engine.env)
    # The images earlier builds left untagged (the cache is this one's parents). A working
    # container a build left behind holds its image: it is ours, as everything in the store is
    # while the lock is held. Only disk is at stake here, never the image just built.
    engine("rm", "--all", "--force", tool="buildah", check=False)
    pruned = engine("image", "prune", "--force", check=False)
    if pruned.returncode != 0:
        print(f"# image prune: exit {pruned.returncode}: {pruned.stderr.strip()[-500:]}", file=log, flush=True)
    return engine("image", "inspect", "--format", "{{.Id}}", APP_TAG).stdout.strip()


def _run(argv: list[str], log, env: dict | None = None, stdin=None) -> None:
    start = time.monotonic()
    print(f"$ {' '.join(argv)}", file=log, flush=True)
    result = subprocess.run(argv, env=env, stdin=stdin, stdout=log, stderr=subprocess.STDOUT)
    print(f"# exit {result.returncode} after {time.monotonic() - start:.1f}s", file=log, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed (exit {result.returncode}); see the build log")


@dataclass
class Image:
    id: str
    config: dict
    """`podman image inspect`'s Config: User, Env, WorkingDir, Cmd, Labels."""

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config["Env"])


def inspect(engine: Engine, image_id: str) -> Image:
    (info,) = json.loads(engine("image", "inspect", image_id).stdout)
    return Image(image_id, info["Config"])


# ---------------------------------------------------------------------------- run


@dataclass
class Container:
    """One container to start: a compose service, a pod's training container, or a command."""

    name: str
    """Its host name; other containers reach it by this and by `aliases`."""
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    volumes: list[str] = field(default_factory=list)
    """podman's HOST:CONTAINER[:OPTIONS]."""
    options: list[str] = field(default_factory=list)
    """More `podman run` options: the user, security settings, /dev/shm, a read-only root."""
    aliases: list[str] = field(default_factory=list)


@dataclass
class Ended:
    codes: list[int | None]
    """Exit codes in the order started, None for one still running at the deadline."""
    logs: dict[str, str]
    diffs: dict[str, list[str]]
    """The paths each container changed in its root filesystem (`podman diff`), but for
    RUNTIME_FILES; volumes are not part of it."""

    def tail(self, chars: int = 3000) -> dict[str, str]:
        return {name: log[-chars:] for name, log in self.logs.items()}


RUNTIME_FILES = {"/etc", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run", "/run/.containerenv"}
"""What podman itself mounts into every container (and their folders, for the mount points)."""


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    return list(zip(items[::2], items[1::2], strict=False))  # a last odd item has no pair


def run_containers(engine: Engine, image: str, containers: list[Container], timeout: float,
                   network=None) -> Ended:
    """Start each container (on its host of `network`, a support.netns.Network, if given; with
    no network otherwise), wait for all of them, and remove them."""
    names = {c.name: f"{engine.run_dir.name}-{c.name}" for c in containers}
    logs = {c.name: engine.run_dir / f"{names[c.name]}.log" for c in containers}  # a pipe could fill and stall
    procs = []
    try:
        for c in containers:
            argv = ["podman", "run", f"--name={names[c.name]}", f"--hostname={c.name}"]
            if network is not None:
                argv += [f"--network=ns:/run/netns/{network.namespaces[c.name]}",
                         f"--cpuset-cpus={network.cpus[c.name]}"]
                argv += [f"--add-host={alias}:{network.addresses[host]}"
                         for host in network.namespaces for alias in [host, *network.aliases[host]]]
            argv += [f"--env={key}={value}" for key, value in c.env.items()]
            argv += [f"--volume={volume}" for volume in c.volumes]
            argv += [*c.options, image, *c.command]
            with open(logs[c.name], "w") as log:
                procs.append(subprocess.Popen(argv, env=engine.env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        from support.processes import wait_all  # psutil: the venv's, which `--base` runs without

        codes = wait_all(procs, timeout)
        for c, proc, code in zip(containers, procs, codes, strict=True):
            if code is None:
                engine("kill", names[c.name], check=False)
                proc.kill()
                proc.wait()
        diffs = {c.name: [path for _, path in _pairs(engine("diff", names[c.name], check=False).stdout.split())
                          if path not in RUNTIME_FILES] for c in containers}
        return Ended(codes, {name: path.read_text() for name, path in logs.items()}, diffs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        engine("rm", "--force", "--time=0", *names.values(), check=False)
        for path in logs.values():
            path.unlink(missing_ok=True)


def main() -> None:
    """`python -m support.image RUN_DIR` (from tests/): build the app image with the engine in RUN_DIR, log to
    RUN_DIR/build.log, write the image ID to RUN_DIR/image-id. conftest runs this in the
    background from the start of a test run, so the build overlaps the other tests.

    `python -m support.image --base`: only the cached part, the CPU base and its wheelhouse, for
    `make test` to build while pip fills the venv (its one core leaves the other idle), with
    any Python 3.11 (it imports nothing outside the standard library). On a fresh machine
    that is most of the build's minutes; the test run then finds it cached."""
    if sys.argv[1:] == ["--base"]:
        engine = Engine.create()
        try:
            engine.lock()
            with open(CACHE / "base-build.log", "w") as log:
                start = time.monotonic()
                base = build_base(engine, log)
            print(f"image base: {base} ready after {time.monotonic() - start:.0f} s (log: {log.name})")
        finally:
            engine.close()
        return
    engine = Engine(Path(sys.argv[1]))
    with open(engine.run_dir / "build.log", "w") as log:
        start = time.monotonic()
        image_id = build_app(engine, log)
        print(f"# built {image_id} in {time.monotonic() - start:.1f}s", file=log, flush=True)
    (engine.run_dir / "image-id").write_text(image_id)


if __name__ == "__main__":
    main()
