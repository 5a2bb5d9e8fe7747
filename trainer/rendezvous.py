"""Who am I in the job: rank, local rank and world size, read once from torchrun's environment.

This is the only module that reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
and the only one that creates or destroys the process group. Everything else receives a
`DistEnv` and asks it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from trainer.config import ConfigError

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
        """True when launched by torchrun (even a world of one): a process group is formed."""
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
        raise ConfigError(f"environment: {name}={environ[name]!r} is not an integer") from None


def read_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """The torchrun contract, or a single process. Anything in between is an error.

    A partial environment is the classic way to get a silent world of one: each process
    thinks it is alone and trains its own model. We refuse to start instead.
    """
    present = [name for name in TORCHRUN_VARS if name in environ]
    if not present:
        slurm_tasks = environ.get("SLURM_NTASKS", "1")
        if slurm_tasks.isdigit() and int(slurm_tasks) > 1 and "SLURM_PROCID" in environ:
            raise ConfigError(
                f"environment: srun started {slurm_tasks} tasks but RANK/WORLD_SIZE are unset; "
                "start one torchrun per node (see slurm/ddp.sh) instead of `python -m trainer` per task"
            )
        return DistEnv()
    missing = [name for name in TORCHRUN_VARS if name not in environ]
    if missing:
        raise ConfigError(
            f"environment: {', '.join(present)} set but {', '.join(missing)} missing; "
            "launch with torchrun, or unset them for a single process"
        )
    rank, local_rank, world_size, port = (
        _int_var(environ, name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    )
    local_world_size = _int_var(environ, "LOCAL_WORLD_SIZE", default=1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"environment: RANK={rank} is outside WORLD_SIZE={world_size}")
    if not 0 <= local_rank < max(local_world_size, 1) or local_rank > rank:
        raise ConfigError(
            f"environment: LOCAL_RANK={local_rank} is inconsistent with RANK={rank}, "
            f"LOCAL_WORLD_SIZE={local_world_size}"
        )
    if not environ["MASTER_ADDR"].strip():
        raise ConfigError("environment: MASTER_ADDR is empty")
    if not 0 < port < 65536:
        raise ConfigError(f"environment: MASTER_PORT={port} is not a valid port")
    restart_count = _int_var(environ, "TORCHELASTIC_RESTART_COUNT", default=0)
    return DistEnv(rank, local_rank, world_size, local_world_size, environ["MASTER_ADDR"], port, restart_count)


def pick_device(dist_env: DistEnv, backend: str) -> tuple[torch.device, str]:
    """The device for this rank and the collective backend, checked before the process group."""
    has_cuda = torch.cuda.is_available()
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
        raise ConfigError(
            f"environment: LOCAL_RANK={dist_env.local_rank} but only {visible} GPU(s) are visible; "
            "--nproc-per-node must not exceed the GPUs per node (or share GPUs with dist.backend=gloo)"
        )
    return torch.device("cuda", dist_env.local_rank), backend


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


def init(dist_env: DistEnv, device: torch.device, backend: str, init_timeout_s: float) -> None:
    """Join the process group. Long timeout: slow nodes, image pulls and the first step."""
    global _control_group
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


def set_timeout(timeout_s: float) -> None:
    """Shorten the collective timeout once the slow first step is behind us.

    After this, a rank that stops answering (dead node, cut link, deadlock) fails every
    collective within `timeout_s` instead of holding the whole job for the init timeout.
    """
    if dist.is_initialized():
        # Every rank calls this at the same step; the barrier makes the switch happen together.
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), _control_group)


def close() -> None:
    """Destroy the process groups. Called on every exit path, errors included."""
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


@contextmanager
def local_rank_zero_first(dist_env: DistEnv) -> Iterator[None]:
    """Local rank 0 runs the body first (it fills the node's caches), then the others.

    The barrier after the body is in a `finally`: if local rank 0 raises, it still releases
    the ranks waiting for it, which then hit the same error themselves instead of waiting
    until the init timeout.
    """
    if dist.is_initialized() and not dist_env.is_local_rank_zero:
        dist.barrier()
    try:
        yield
    finally:
        if dist.is_initialized() and dist_env.is_local_rank_zero:
            dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks, in place; the identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def any_rank_async(flag: bool) -> tuple[dist.Work, torch.Tensor]:
    """Start an all-reduce (max) of `flag` on the control group: (work, result tensor)."""
    tensor = torch.tensor([int(flag)], dtype=torch.int32)
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group, async_op=True), tensor

