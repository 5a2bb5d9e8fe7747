"""train.strategy=fsdp: FSDP2 (fully_shard), one process per device, each holding 1/N of the
weights, gradients and optimizer state (docs/fsdp.md).

The bare model itself is sharded in place: its parameters become DTensors. Checkpoints keep
them so, each rank writing its own shards with torch.distributed.checkpoint (DCP), which
reshards them on load for any world size (trainer/checkpoint/formats.py's SHARDED, also in a
single process, so that one process and N ranks resume each other). final/ is written the same
way, in Hugging Face's safetensors format. One process without a process group runs the model
unsharded.
"""

from __future__ import annotations

import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainer.checkpoint import formats
from trainer.config.schema import Config
from trainer.errors import CheckpointError, ConfigError
from trainer.model import packing
from trainer.model.pretrained import transformer_blocks
from trainer.runtime import distributed
from trainer.strategies.base import Strategy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel


def fully_shard_model(model: nn.Module, reshard_after_forward: bool, amp_dtype: torch.dtype) -> None:
    """FSDP2 on `model`, in place: each transformer block is a unit of its own (its weights
    are gathered for its forward and backward alone), and the root holds the rest
    (embeddings, head). Under bf16, the weights are gathered in bf16 and the gradients
    reduced in fp32; fp32 runs gather and reduce fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if amp_dtype == torch.float16:
        raise ConfigError("train.strategy: fsdp runs in bf16 or fp32; fp16's loss scaler is DDP's only "
                          "(train.precision=auto picks fp16 on GPUs before Ampere: set train.precision=fp32)")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if amp_dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root's weights are needed again at once by the backward: kept gathered.
    fully_shard(model, reshard_after_forward=False, mp_policy=policy)


class FSDP(Strategy):
    name = "fsdp"
    checkpoint_format = formats.SHARDED
    forecast_unsupported = "the forecast models DDP, not train.strategy=fsdp (docs/forecast.md)"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._model: nn.Module | None = None

    def memory_shards(self, world_size: int) -> int:
        return world_size

    def gathered_bytes(self, model: nn.Module, compute: torch.dtype, world_size: int) -> int:
        """An estimate of what FSDP gathers whole at once, in the compute dtype: two blocks (the
        one computing, the next one prefetched) and what the root holds (embeddings, head),
        which stays gathered from the forward to the backward."""
        if world_size == 1:
            return 0
        blocks = transformer_blocks(model)
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
        return (2 * block + root) * (torch.finfo(compute).bits // 8)

    def prepare(self, model, dist_env, device, amp_dtype) -> None:
        if dist_env.is_distributed:
            fully_shard_model(model, self.cfg.fsdp.reshard_after_forward, amp_dtype)
            if self.cfg.data.packing:
                packing.through_fsdp_root(model)
            self._model, self.sharded = model, True

    def sync_gradients(self, now: bool) -> AbstractContextManager:
        if self._model is not None:  # the reduce-scatter waits for the last micro-batch, as DDP's all-reduce does
            cast("FSDPModule", self._model).set_requires_gradient_sync(now)
        return nullcontext()

    def gathered_trained_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trained weights (LoRA's adapters and head), whole and on the CPU on rank 0
        (empty elsewhere): small enough to gather."""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=options))  # no DTensor left

    def save_pretrained(self, model: PreTrainedModel, folder: Path, dist_env) -> None:
        """Sharded, through DCP's Hugging Face writer: each rank writes its own shards, then
        rank 0 merges them tensor by tensor into model-*.safetensors and its index, never
        holding the whole model; the per-rank files are removed. Then rank 0 writes the
        config, naming the class FSDP2 subclassed (FSDP<name>)."""
        if not self.sharded:
            super().save_pretrained(model, folder, dist_env)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        writer = HuggingFaceStorageWriter(path=str(folder), save_distributed=True, enable_consolidation=True)
        try:
            with formats.dcp_failures():
                dcp.save(get_model_state_dict(model), storage_writer=writer)
        except formats.ShardsError as e:  # e.g. a full disk on any rank: every rank fails with why
            raise CheckpointError(f"output_dir: {folder}: export failed: {e}") from None

        def config() -> None:
            shutil.rmtree(folder / "sharded", ignore_errors=True)
            model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
            model.config.save_pretrained(folder)

        distributed.rank_zero_does(dist_env, f"output_dir: {folder}", config)
