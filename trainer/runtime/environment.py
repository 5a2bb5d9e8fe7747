"""This process's place in the job, from its launcher's environment: the one module that reads
RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Everything else receives a
`DistEnv` and asks it: `dist_env.is_distributed` is the one answer to "is there a process group".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import LaunchError

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
