"""Gradient compression for DDP's all-reduce (`ddp.comm_hook`), from torch's own DDP comm
hooks (torch.distributed.algorithms.ddp_comm_hooks).

- bf16 / fp16: each bucket is cast before the all-reduce and back after it: half the bytes.
- powersgd (Vogels et al., 2019): each gradient matrix is sent as two rank-r factors, and
  what the approximation dropped (the error feedback) is added to the next step's gradient.
  Vectors (biases, norms) go uncompressed. The first `ddp.powersgd_start_step` steps run the
  exact all-reduce.

PowerSGD's state is each rank's own: its error feedback, and the factors it warm-starts
from. `PowerSGD` is that state as a checkpoint keeps it, one file per rank, so that a resume
at the same world size is bitwise. A sparse bucket (the embedding's rows, see
ddp.sparse_embedding_grad) is all-reduced as it is: only its touched rows travel already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from trainer.config.schema import DDPConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Hook = Callable[[Any, "torch.distributed.GradBucket"], "torch.futures.Future[torch.Tensor]"]


class PowerSGD:
    """torch's PowerSGDState for this rank, and its checkpoint state (Stateful)."""

    def __init__(self, ddp_cfg: DDPConfig, group: ProcessGroup | None = None):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        # The hook counts the all-reduces it has run (its `iter`), and compresses from
        # start_powerSGD_iter on: the steps before run the exact all-reduce.
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=ddp_cfg.powersgd_rank,
                                   start_powerSGD_iter=ddp_cfg.powersgd_start_step)

    def state_dict(self) -> dict:
        rng = cast("tuple[str, np.ndarray, int, int, float]", self.state.rng.get_state())  # MT19937's, not a dict
        return {"world_size": dist.get_world_size(), "iter": self.state.iter, "error": dict(self.state.error_dict),
                "p": dict(self.state.p_memory_dict), "q": dict(self.state.q_memory_dict),
                "rng": [rng[0], torch.from_numpy(rng[1].astype(np.int64)), *rng[2:]]}

    def discard(self) -> None:
        """After a skipped step, whose gradients were not finite: the error feedback and the
        warm-start factors carry them, so they start over (from zero, and from the RNG)."""
        self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict = {}, {}, {}

    def load_state_dict(self, saved: dict) -> None:
        """A rank's saved state. Saved at another world size (the checkpoint then hands every
        rank rank 0's), no rank's error feedback is this rank's: it starts from zero, and the
        factors and the step count carry on."""
        name, keys, *rest = saved["rng"]
        self.state.rng.set_state((name, keys.numpy().astype(np.uint32), *rest))
        self.state.iter = saved["iter"]
        self.state.p_memory_dict, self.state.q_memory_dict = dict(saved["p"]), dict(saved["q"])
        self.state.error_dict = dict(saved["error"]) if saved["world_size"] == dist.get_world_size() else {}


def make(ddp_cfg: DDPConfig, backend: str, group: ProcessGroup | None = None) -> tuple[Any, Hook, PowerSGD | None]:
    """(hook state, hook, PowerSGD's checkpointed state or None) for ddp.comm_hook, over
    `group` (None: every rank; DDP's group must be the same)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    powersgd = PowerSGD(ddp_cfg, group) if ddp_cfg.comm_hook == "powersgd" else None
    compress = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
                "fp16": default_hooks.fp16_compress_hook, "powersgd": powerSGD_hook.powerSGD_hook}[ddp_cfg.comm_hook]

    # PowerSGD issues its second and third all-reduce from the first one's completion callback.
    # gloo completes in threads of its own, so the next bucket's all-reduce, issued meanwhile by
    # the backward, could take its place in the group's order on one rank and not on another:
    # a hang. Waiting for each bucket, the sparse one too, keeps one order and one collective
    # in flight (a sparse all-reduce left running beside PowerSGD's corrupted the heap, see
    # docs/compression.md). NCCL completes a future as its kernel is enqueued, in this
    # thread: its order is the issuing order already.
    in_order = powersgd is not None and backend == "gloo"

    def hook(state, bucket):
        if bucket.buffer().is_sparse:
            if powersgd is not None:  # PowerSGD counts its steps at the last bucket, which this may be
                powersgd.state.maybe_increase_iter(bucket)
            reduced = default_hooks.allreduce_hook(cast("ProcessGroup", group), bucket)
        else:
            reduced = cast(Hook, compress)(state, bucket)
        if in_order:
            reduced.wait()
        return reduced

    return (powersgd.state if powersgd else group), hook, powersgd
