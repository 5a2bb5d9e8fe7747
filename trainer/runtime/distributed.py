"""The process groups and what ranks do together: created and destroyed here alone (with
NCCL's flight recorder and the timeouts), the collectives everything else uses, which are the
identity without a process group, and the agreements on a failure (`rank_zero_does`,
`every_rank_does`, `local_rank_zero_first`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from trainer import errors
from trainer.errors import LaunchError, TrainerError
from trainer.runtime.environment import DistEnv

T = TypeVar("T")
log = logging.getLogger(__name__)

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
