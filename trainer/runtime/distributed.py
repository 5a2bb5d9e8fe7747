"""The distributed runtime: who this process is in the job, its device and its precision.

The only module that reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, picks
the device, the precision and the CPU threads, and creates or destroys process groups.
Everything else receives a `DistEnv` and asks it: `dist_env.is_distributed` is the one answer
to "is there a process group", and the collective helpers below are the identity without one.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from trainer import errors
from trainer.config.schema import TrainConfig
from trainer.errors import ConfigError, LaunchError, TrainerError

T = TypeVar("T")
log = logging.getLogger(__name__)
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    """How many times torchrun has restarted the workers (TORCHELASTIC_RESTART_COUNT)."""

    @property
    def is_distributed(self) -> bool:
        """True when launched by torchrun (even a world of one): the process group is formed
        before anything else runs, so this is also "may this rank enter a collective"."""
        return bool(self.master_addr)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank_zero(self) -> bool:
        return self.local_rank == 0


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    if default is not None and name not in environ:
        return default
    try:
        return int(environ[name])
    except ValueError:
        raise LaunchError(f"environment: {name}={environ[name]!r} is not an integer") from None


def read_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """The torchrun contract, or a single process. Anything in between is an error.

    A partial environment is the classic way to get a silent world of one: each process
    thinks it is alone and trains its own model. We refuse to start instead.
    """
    present = [name for name in TORCHRUN_VARS if name in environ]
    if not present:
        slurm_tasks = environ.get("SLURM_NTASKS", "1")
        if slurm_tasks.isdigit() and int(slurm_tasks) > 1 and "SLURM_PROCID" in environ:
            raise LaunchError(
                f"environment: srun started {slurm_tasks} tasks but RANK/WORLD_SIZE are unset; "
                "start one torchrun per node (see slurm/ddp.sh) instead of `python -m trainer` per task"
            )
        return DistEnv()
    missing = [name for name in TORCHRUN_VARS if name not in environ]
    if missing:
        raise LaunchError(
            f"environment: {', '.join(present)} set but {', '.join(missing)} missing; "
            "launch with torchrun, or unset them for a single process"
        )
    rank, local_rank, world_size, port = (
        _int_var(environ, name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    )
    local_world_size = _int_var(environ, "LOCAL_WORLD_SIZE", default=1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"environment: RANK={rank} is outside WORLD_SIZE={world_size}")
    if not 0 <= local_rank < max(local_world_size, 1) or local_rank > rank:
        raise LaunchError(
            f"environment: LOCAL_RANK={local_rank} is inconsistent with RANK={rank}, "
            f"LOCAL_WORLD_SIZE={local_world_size}"
        )
    if not environ["MASTER_ADDR"].strip():
        raise LaunchError("environment: MASTER_ADDR is empty")
    if not 0 < port < 65536:
        raise LaunchError(f"environment: MASTER_PORT={port} is not a valid port")
    restart_count = _int_var(environ, "TORCHELASTIC_RESTART_COUNT", default=0)
    return DistEnv(rank, local_rank, world_size, local_world_size, environ["MASTER_ADDR"], port, restart_count)


def granted_gpus(environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable that shows the scheduler or container runtime granted this job GPUs,
    as `NAME=value`, or None. Slurm sets SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES for
    a GPU allocation; the NVIDIA container runtime reads NVIDIA_VISIBLE_DEVICES (CUDA
    images set it to `all`); `void`, `none`, empty or -1 mean none."""
    slurm = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        return f"SLURM_GPUS_ON_NODE={slurm}"
    for name, none in (("CUDA_VISIBLE_DEVICES", {"", "-1", "nodevfiles"}),
                       ("NVIDIA_VISIBLE_DEVICES", {"", "void", "none"})):
        value = environ.get(name)
        if value is not None and value.strip().lower() not in none:
            return f"{name}={value}"
    return None


CUDA_DRIVER_FLOOR = {"12": "525.60.13", "13": "580.65.06"}
"""The oldest Linux driver each CUDA major version runs on (NVIDIA's minor version
compatibility); TRAINER_MIN_CUDA_DRIVER, which the image sets for its base, wins."""


def nvidia_driver(version_file: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The host's NVIDIA kernel driver version (a container sees the host's), or None."""
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", version_file.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def driver_check(driver: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """(a line on `driver` and the CUDA torch is built for, why it is too old or None)."""
    cuda = torch.version.cuda
    if driver is None or cuda is None:
        return ("no NVIDIA driver" if driver is None else f"NVIDIA driver {driver}, CPU-only torch"), None
    floor = environ.get("TRAINER_MIN_CUDA_DRIVER") or CUDA_DRIVER_FLOOR.get(cuda.split(".")[0])
    line = f"NVIDIA driver {driver}, torch built for CUDA {cuda}" + (f" (needs {floor} or newer)" if floor else "")
    def parts(version: str) -> tuple[int, ...]:
        return tuple(int(n) for n in version.split("."))
    if floor and parts(driver) < parts(floor):
        return line, (f"the NVIDIA driver {driver} is older than {floor}, the oldest CUDA {cuda} runs on: upgrade "
                      "the nodes' driver, or use a torch (an image) built for an older CUDA")
    return line, None


def _no_usable_cuda(why_gpus: str) -> LaunchError:
    _, old_driver = driver_check(nvidia_driver())
    build = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} (is the driver older, or "
             "was the container started without --gpus / --nv?)" if torch.version.cuda
             else f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
    if old_driver:
        build = old_driver
    return LaunchError(
        f"train.device: {why_gpus}, but torch.cuda.is_available() is False: {build}; "
        "to train on CPU on purpose, set train.device=cpu dist.backend=gloo"
    )


def pick_device(dist_env: DistEnv, backend: str, device_choice: str = "auto",
                environ: Mapping[str, str] = os.environ) -> tuple[torch.device, str]:
    """The device for this rank and the collective backend, checked before the process group.

    Never a silent fall back to the CPU: a job granted GPUs that CUDA cannot use would train
    hundreds of times slower on gloo. Training on CPU there takes train.device=cpu.
    """
    if device_choice == "cpu":
        if backend == "nccl":
            raise ConfigError("dist.backend: nccl needs GPUs, and train.device is cpu; use gloo or auto")
        return torch.device("cpu"), "gloo"
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        granted = granted_gpus(environ)
        if granted:
            raise _no_usable_cuda(f"{granted} grants this job GPUs")
        if device_choice == "cuda":
            raise _no_usable_cuda("cuda")
    if backend == "auto":
        backend = "nccl" if has_cuda else "gloo"
    if backend == "nccl" and not has_cuda:
        raise ConfigError("dist.backend: nccl needs CUDA, and no GPU is visible; use gloo or auto")
    if not has_cuda:
        return torch.device("cpu"), backend
    visible = torch.cuda.device_count()
    if dist_env.local_rank >= visible:
        if backend == "gloo":
            # gloo all-reduces CUDA tensors through host memory, so ranks may share a GPU
            # (a one-GPU workstation testing a multi-rank job): an explicit choice.
            return torch.device("cuda", dist_env.local_rank % visible), backend
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") only at the first
        # collective. Usually torchrun --nproc-per-node exceeds the GPUs per node.
        raise LaunchError(
            f"environment: LOCAL_RANK={dist_env.local_rank} but only {visible} GPU(s) are visible; "
            "--nproc-per-node must not exceed the GPUs per node (or share GPUs with dist.backend=gloo)"
        )
    return torch.device("cuda", dist_env.local_rank), backend


def has_native_bf16(device: torch.device) -> bool:
    """Whether the device runs bf16 matmuls in hardware."""
    if device.type == "cuda":
        # Not torch.cuda.is_bf16_supported() as called by default: it also answers True where
        # bf16 is only emulated (V100, T4), far slower than fp16 there.
        return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)
    if platform.machine() in ("x86_64", "AMD64"):
        # AVX512-BF16 or AMX: bf16 matmuls ~2.5x fp32 (benchmarks/RESULTS.md). Not mkldnn's own
        # check, which answers True for any AVX-512 CPU, those without bf16 instructions too;
        # and not where ATEN_CPU_CAPABILITY keeps torch's kernels below AVX-512.
        return (torch.backends.cpu.get_cpu_capability() == "AVX512"
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    # Arm: mkldnn checks the BF16 extension (Neoverse V1 and newer, Apple M2 and newer).
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype (float32: no autocast). auto: bf16 where the device has it in
    hardware; else fp16 (with a loss scaler) on a GPU, where it has tensor cores since
    Volta, and fp32 on a CPU, where fp16 has no fast kernels."""
    explicit = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision in explicit:
        if precision == "bf16" and not has_native_bf16(device):
            if device.type == "cuda":
                log.warning("train.precision: bf16 is emulated on %s, and slow; fp16 (or auto) is fast there",
                            torch.cuda.get_device_name(device))
            else:
                log.warning("train.precision: bf16 is emulated on this CPU (%s), about 15x slower than fp32; "
                            "fp32 (or auto) is fast here", _missing_cpu_bf16())
        return explicit[precision]
    if has_native_bf16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else torch.float32


def _missing_cpu_bf16() -> str:
    if platform.machine() in ("x86_64", "AMD64"):
        return "no AVX512-BF16, no AMX"
    return f"{platform.machine()}: no BF16 extension"


def cpu_threads(dist_env: DistEnv, threads: int | None) -> int:
    """Intra-op threads: the CPUs this process may use, shared among the node's ranks."""
    return threads or max(1, len(os.sched_getaffinity(0)) // dist_env.local_world_size)


def configure_compute(train_cfg: TrainConfig, dist_env: DistEnv, device: torch.device) -> torch.dtype:
    """This process's compute as train.* sets it, before the model is built: deterministic
    kernels, the CPU threads, and the autocast dtype it returns (resolve_precision). Every
    command that runs the model calls it once (trainer/train/build.py)."""
    if train_cfg.deterministic:
        use_deterministic_kernels()
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(dist_env, train_cfg.threads))
    return resolve_precision(train_cfg.precision, device)


def use_deterministic_kernels() -> None:
    """Make every kernel bitwise reproducible, or fail at the first one that cannot be.

    Before the first cuBLAS call: cuBLAS reads its workspace setting when it creates its
    handle, and with the default one its reductions are split in a varying order.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# A second, CPU-only (gloo) group for small agreements between ranks, such as the
# preemption flag: on it they never wait behind, or sync with, the GPU stream.
_control_group: dist.ProcessGroup | None = None
# A third, for DCP's background checkpoint writes (checkpoint.async_save under FSDP): their
# collectives run in a thread of their own, beside the step's on the default group and the
# flags on the control group. Sharing either group would interleave them, and hang.
_checkpoint_group: dist.ProcessGroup | None = None
_timeout: timedelta | None = None


def flight_recorder_env(backend: str, output_dir: Path) -> dict[str, str]:
    """PyTorch's NCCL flight recorder: each rank keeps its last collectives in a ring buffer
    and, when NCCL's watchdog times one out, dumps them to output_dir/nccl-trace/rank_N,
    which says which collective each rank was in (docs/faults.md, "Hangs and lost nodes"). NCCL
    only: under gloo these variables would do nothing, so they are left unset."""
    if backend != "nccl":
        return {}
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{output_dir}/nccl-trace/rank_"}


def nccl_dump_prefix(dist_env: DistEnv) -> str | None:
    """Where the flight recorder dumps, `PREFIX<rank>`, if it is on."""
    if dist_env.is_distributed and dist.get_backend() == "nccl":
        return os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    return None


def init(dist_env: DistEnv, device: torch.device, backend: str, init_timeout_s: float, output_dir: Path) -> None:
    """Join the process group. Long timeout: slow nodes, image pulls and the first step."""
    global _control_group, _timeout
    for name, value in flight_recorder_env(backend, output_dir).items():
        os.environ.setdefault(name, value)  # read when the NCCL process group is created
    if device.type == "cuda":
        # Before any CUDA call: otherwise every rank creates a context on GPU 0.
        torch.cuda.set_device(device)
    if not dist_env.is_distributed:
        return
    timeout = timedelta(seconds=init_timeout_s)
    dist.init_process_group(
        backend=backend,
        rank=dist_env.rank,
        world_size=dist_env.world_size,
        timeout=timeout,
        # Binds NCCL's communicator to this GPU now; gloo takes no device.
        device_id=device if backend == "nccl" else None,
    )
    _control_group = dist.new_group(backend="gloo", timeout=timeout)
    _timeout = timeout


def checkpoint_group(dist_env: DistEnv) -> dist.ProcessGroup | None:
    """The background checkpoint writes' gloo group (None in one process). Made at the
    first call, which is a collective: every rank makes it at the same save."""
    global _checkpoint_group
    if not dist_env.is_distributed:
        return None
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo", timeout=_timeout)
    return _checkpoint_group


def set_timeout(dist_env: DistEnv, timeout_s: float) -> None:
    """Shorten the collective timeout once the slow first step is behind us.

    After this, a rank that stops answering (dead node, cut link, deadlock) fails every
    collective within `timeout_s` instead of holding the whole job for the init timeout.
    """
    global _timeout
    if dist_env.is_distributed:
        # Every rank calls this at the same step; the barrier makes the switch happen together.
        dist.barrier()
        _timeout = timedelta(seconds=timeout_s)
        dist.distributed_c10d._set_pg_timeout(_timeout)
        for group in (_control_group, _checkpoint_group):
            if group is not None:
                dist.distributed_c10d._set_pg_timeout(_timeout, group)


def backend(dist_env: DistEnv) -> str:
    """The process group's backend, for the logs."""
    return dist.get_backend() if dist_env.is_distributed else "no process group"


def close() -> None:
    """Destroy the process groups. Called on every exit path, errors included, so it asks
    torch itself whether init got as far as creating them."""
    global _control_group, _checkpoint_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = _checkpoint_group = None


@contextmanager
def local_rank_zero_first(dist_env: DistEnv, what: str) -> Iterator[None]:
    """Local rank 0 runs the body first (it fills the node's caches), then the others.

    A failure of any node's local rank 0 in the body is every rank's, at once: after the
    barrier the ranks share local rank 0's outcome, and each raises its one-line error (`what:
    rank N: ...` where it is not already a TrainerError). The others would otherwise run the
    body themselves, where they may not meet the same error (they read what local rank 0 left
    in the cache, or redo its work in another way, for minutes), and then wait at a collective
    that local rank 0 never joins. The barrier is in a `finally`, so that a failed local rank 0
    still releases the ranks waiting for it.
    """
    if not dist_env.is_distributed:
        yield
        return
    if not dist_env.is_local_rank_zero:
        _barrier()
        _raise_on_every_rank(_first_error(dist_env, None))
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # raised again below, as every rank raises it
        error = _error_of(f"{what}: rank {dist_env.rank}", e)
        raise
    finally:
        _barrier()
        _raise_on_every_rank(_first_error(dist_env, error))


def _first_error(dist_env: DistEnv, error: tuple[str, str] | None) -> tuple[str, str] | None:
    """The first rank's error of those that ranks hold, by rank, on every rank."""
    return next((e for e in all_gather(dist_env, error) if e is not None), None)


_meanwhile: list[Callable[[], bool]] = []


@contextmanager
def meanwhile(work: Callable[[], bool]) -> Iterator[None]:
    """In the body, a rank that waits at local_rank_zero_first's barrier (the others for
    local rank 0's data) calls `work()` while it waits, again until the barrier is passed or
    `work()` returns False (none left): for work the rank would do after the barrier anyway,
    such as its next imports (startup.Prefetch). The barrier itself is the same one, with the
    same timeout; a `work()` call that outlasts the wait delays this rank by what is left of it."""
    _meanwhile.append(work)
    try:
        yield
    finally:
        _meanwhile.remove(work)


_ALREADY_THERE_S = 0.01
"""A barrier the other ranks already wait at passes within about a millisecond (loopback
gloo): `meanwhile` work starts only after this long, so a rank with no wait ahead of it
does not take on work there (its phases, startup_s, would count it in the wrong one)."""


def _barrier() -> None:
    if not _meanwhile:
        dist.barrier()
        return
    passed = dist.barrier(async_op=True)
    deadline = time.monotonic() + _ALREADY_THERE_S
    while not passed.is_completed() and time.monotonic() < deadline:
        time.sleep(0.0005)
    while not passed.is_completed() and _meanwhile[-1]():
        pass
    passed.wait()


# --- collectives that are the identity in a single process -------------------------------


def all_reduce_sum(dist_env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks, in place."""
    if dist_env.is_distributed:
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_rank_zero(dist_env: DistEnv, value):
    """Rank 0's `value` (a picklable object), on every rank."""
    if not dist_env.is_distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_to_rank_zero(dist_env: DistEnv, value) -> list | None:
    """Every rank's `value`, by rank, on rank 0; None on the others."""
    if not dist_env.is_distributed:
        return [value]
    gathered = [None] * dist_env.world_size if dist_env.is_rank_zero else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def all_gather(dist_env: DistEnv, value) -> list:
    """Every rank's `value`, by rank, on every rank."""
    if not dist_env.is_distributed:
        return [value]
    gathered = [None] * dist_env.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def rank_zero_does(dist_env: DistEnv, what: str, action: Callable[[], T]) -> T | None:
    """`action()` on rank 0 (its result there; None on the others). If it fails, every rank
    raises the same one-line error at once.

    For what only rank 0 does (choosing the checkpoint, creating output_dir, starting
    wandb, the export): otherwise rank 0's failure would leave the others waiting at their
    next collective until the init timeout, 30 minutes by default. `what` names the thing
    done, and starts the message of an error that is not already a TrainerError.
    """
    result, error = (_attempt(what, action) if dist_env.is_rank_zero else (None, None))
    _raise_on_every_rank(broadcast_from_rank_zero(dist_env, error))
    return result


def every_rank_does(dist_env: DistEnv, what: str, action: Callable[[], T]) -> T:
    """`action()` on every rank. If it fails on any rank, every rank raises the first failing
    rank's one-line error (`what: rank N: ...` where it is not already a TrainerError), instead
    of the others going on to a collective that rank will never join."""
    result, error = _attempt(f"{what}: rank {dist_env.rank}", action)
    _raise_on_every_rank(_first_error(dist_env, error))
    return cast(T, result)


def _attempt(what: str, action: Callable[[], T]) -> tuple[T | None, tuple[str, str] | None]:
    """(action's result, None) or (None, the error as `_error_of` says it)."""
    try:
        return action(), None
    except Exception as e:  # a full or read-only disk, a service that refuses: one line  # noqa: BLE001
        return None, _error_of(what, e)


def _error_of(what: str, e: Exception) -> tuple[str, str]:
    """An error as every rank raises it: (TrainerError class name, message), `what: ...` for
    another library's."""
    if isinstance(e, TrainerError):
        return type(e).__name__, str(e)
    return LaunchError.__name__, f"{what}: {errors.describe(e)}"


def _raise_on_every_rank(error: tuple[str, str] | None) -> None:
    if error is not None:
        kind, message = error
        raise getattr(errors, kind)(message)


def any_rank_async(flag: bool) -> tuple[dist.Work, torch.Tensor]:
    """Start an all-reduce (max) of `flag` on the control group: (work, result tensor)."""
    tensor = torch.tensor([int(flag)], dtype=torch.int32)
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group, async_op=True), tensor
