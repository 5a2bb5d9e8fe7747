"""How the training step runs the model across ranks: DDP, FSDP2, nn.DataParallel,
torch.compile, and the communication techniques wired into them.

`Parallel` is everything the step needs beyond the bare model: the module to call, when
gradients are synchronized (no_sync on all but the last micro-batch), the comm clock that
measures exposed communication, and the sparse embedding gradient on CPU.

Under FSDP2 the bare model itself is sharded in place (fully_shard turns its parameters into
DTensors): checkpoints, evaluation and the export then see a sharded model, and gather it
through torch.distributed.checkpoint's state-dict helpers (trainer/sharded.py).
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import compression, distributed
from trainer.data import BatchPlan
from trainer.distributed import DistEnv
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel


class SparseEmbeddingGrad:
    """The input embedding's gradient as sparse rows through backward and the all-reduce,
    then scattered into one persistent dense buffer for clipping and the fused AdamW step.

    AdamW needs a dense gradient (its moments decay on every row). A fresh one each step
    would fault in 47 MB of new pages on MiniLM; in the reused buffer only the rows the
    previous step wrote are non-zero, so only those are cleared.
    """

    def __init__(self, embedding: nn.Embedding):
        embedding.sparse = True  # before DDP is built: DDP reads it to bucket the gradient alone
        self.weight = embedding.weight
        self.dense = torch.zeros_like(self.weight)
        self.written_rows = torch.zeros(0, dtype=torch.long, device=self.weight.device)

    @classmethod
    def maybe(cls, model: PreTrainedModel, cfg: DictConfig, device: torch.device) -> SparseEmbeddingGrad | None:
        embedding = model.get_input_embeddings()
        if (cfg.ddp.sparse_embedding_grad and cfg.train.strategy == "ddp" and device.type == "cpu"
                and isinstance(embedding, nn.Embedding)
                and embedding.weight.requires_grad):  # frozen under LoRA: no gradient at all
            return cls(embedding)
        return None

    def densify(self) -> None:
        grad = self.weight.grad
        if grad is None or not grad.is_sparse:
            return
        grad = grad.coalesce()  # sums repeated tokens in a fixed order: deterministic
        rows = grad.indices()[0]
        self.dense.index_fill_(0, self.written_rows, 0)  # every other row is still zero
        self.dense.index_copy_(0, rows, grad.values())
        self.weight.grad, self.written_rows = self.dense, rows


# torch 2.13 renamed DDP's broadcast_buffers (now deprecated, with a warning) to
# forward_sync_buffers; images built on an earlier torch know only the old name.
_FORWARD_SYNC_BUFFERS = next(name for name in ("forward_sync_buffers", "broadcast_buffers")
                             if name in inspect.signature(DistributedDataParallel).parameters)


class LogitsUnderAutocast(nn.Module):
    """The classifier's logits, computed under autocast with the configured dtype in
    whichever thread runs the forward.

    Autocast is thread-local, and nn.DataParallel runs each replica in a thread of its
    own, where it re-enters autocast without a dtype: the device's default, fp16 on CUDA.
    A bf16 run would silently compute in fp16, with no loss scaler. Entered here, inside
    each replica's forward, it is the configured dtype. Logits rather than transformers'
    loss: DataParallel gathers them, and the loss is then taken over the whole batch.
    """

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.model(**inputs).logits


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every sample of the batch, in fp32. Over the gathered
    logits, not as a mean of DataParallel's per-replica means, which would weigh the samples
    of an uneven split (5 samples on 2 GPUs: 3 and 2) unequally."""
    return F.cross_entropy(logits.float(), labels)


def check_world_size(train_cfg: DictConfig, world_size: int) -> None:
    """What the config asks of the world size, checked by each rank before the rendezvous."""
    if train_cfg.strategy == "dp" and world_size > 1:
        raise ConfigError("train.strategy: dp (nn.DataParallel) runs in one process; launch without torchrun "
                          "or with --nproc-per-node=1, or use ddp")
    BatchPlan.of(train_cfg, world_size)  # a global batch this world size can't split


def _wrap(model: nn.Module, cfg: DictConfig, dist_env: DistEnv, device: torch.device) -> nn.Module:
    """The module the training step calls: DDP, DataParallel, or the model itself (also
    under FSDP2, whose sharding is in the model: `_fully_shard`)."""
    if cfg.train.strategy == "fsdp":
        wrapped: nn.Module = model
    elif cfg.train.strategy == "dp":
        wrapped = nn.DataParallel(model) if torch.cuda.device_count() > 1 else model
    elif dist_env.is_distributed:
        wrapped = ddp_wrap(model, cfg.ddp, device)
    else:
        wrapped = model
    if cfg.train.compile:
        wrapped = cast(nn.Module, torch.compile(wrapped))  # of a Module: an OptimizedModule, a Module
    return wrapped


def ddp_wrap(model: nn.Module, ddp_cfg: DictConfig, device: torch.device,
             group: ProcessGroup | None = None) -> DistributedDataParallel:
    """DDP as ddp.* configures it, over `group` (None: every rank)."""
    # Buffers (position ids) never change: no broadcast before each forward.
    no_buffer_sync: dict[str, Any] = {_FORWARD_SYNC_BUFFERS: False}
    _skip_frozen_at_start(model)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=ddp_cfg.bucket_cap_mb,
        gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view,
        static_graph=ddp_cfg.static_graph,
        # Every parameter that trains gets a gradient (DDP leaves frozen ones, LoRA's base,
        # out of its buckets); searching for unused ones costs a graph traversal per step.
        # Except under PowerSGD, whose state is keyed by bucket: DDP re-buckets after its
        # first step (in the order gradients became ready) unless it searches, and a
        # resumed process would compress its first step's buckets with another bucket's
        # error feedback. Searching, DDP keeps its first buckets in every process.
        find_unused_parameters=ddp_cfg.comm_hook == "powersgd",
        **no_buffer_sync,
    )


def _skip_frozen_at_start(model: nn.Module) -> None:
    """DDP broadcasts rank 0's weights as it starts, so that every rank begins alike. The
    weights that never train (LoRA's frozen base) every rank has loaded from model.name's
    files already: broadcasting them would take seconds per GB and, on CPU, write over each
    rank's memory-mapped copy of the file, turning the node's one shared page cache into a
    private copy per rank. What trains (adapters, head) is still broadcast."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        # torch's interim API for this (pytorch/pytorch#43690); DDP reads it as it starts.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer, FSDP's units: the children of the model's largest
    ModuleList of same-class modules (BERT's encoder.layer, Llama's model.layers, GPT-2's h)."""
    stacks = [stack for stack in model.modules() if isinstance(stack, nn.ModuleList) and len(stack) > 0
              and len({type(block) for block in stack}) == 1]
    if not stacks:
        return []
    largest = max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))
    return list(largest)


def fully_shard_model(model: nn.Module, cfg: DictConfig, amp_dtype: torch.dtype) -> None:
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
    reshard = cfg.fsdp.reshard_after_forward
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    # The root's weights are needed again at once by the backward: kept gathered.
    fully_shard(model, reshard_after_forward=False, mp_policy=policy)


class CommClock:
    """A DDP comm hook: ddp.comm_hook's (trainer/compression.py), noting when each bucket
    became ready.

    The last bucket is ready when backward's compute is done, so whatever backward() still
    takes after that is communication that did not overlap with compute (exposed). Exact
    on CPU, where backward() blocks until the all-reduce ends. On GPU the host runs ahead
    of the kernels, and the wait shows up in the next phase that synchronizes. Its times
    are time.perf_counter's, the clock of the Meter's phases.
    """

    def __init__(self, hook) -> None:
        self.hook = hook
        self.last_ready: float | None = None

    @classmethod
    def attach(cls, ddp: torch.nn.parallel.DistributedDataParallel, hook_state, hook) -> CommClock:
        clock = cls(hook)
        ddp.register_comm_hook(hook_state, clock._hook)
        return clock

    def _hook(self, state, bucket):
        self.last_ready = time.perf_counter()
        return self.hook(state, bucket)

    def take(self) -> float | None:
        """When the last bucket of the latest backward became ready (None without one)."""
        taken, self.last_ready = self.last_ready, None
        return taken


class Parallel:
    """The model as the training step runs it on this rank."""

    def __init__(self, model: PreTrainedModel, cfg: DictConfig, dist_env: DistEnv, device: torch.device,
                 amp_dtype: torch.dtype):
        # Before DDP is built: DDP reads `sparse` to put the embedding's gradient in its own bucket.
        self.sparse_embedding = SparseEmbeddingGrad.maybe(model, cfg, device)
        self.fsdp = cfg.train.strategy == "fsdp" and dist_env.is_distributed
        """The model is sharded (fully_shard): every rank must run each forward and backward."""
        if self.fsdp:
            fully_shard_model(model, cfg, amp_dtype)
        self.logits = LogitsUnderAutocast(model, device.type, amp_dtype)
        """The bare model's logits in the run's precision, with no wrapper: what evaluation calls."""
        self.module = _wrap(self.logits, cfg, dist_env, device)
        """What the step calls for logits: DDP, DataParallel, compiled, or the model itself."""
        ddp = getattr(self.module, "_orig_mod", self.module)  # under torch.compile
        self._ddp = ddp if isinstance(ddp, DistributedDataParallel) else None
        self.comm_clock: CommClock | None = None
        """When the last gradient bucket became ready, for the exposed-communication phase."""
        self.powersgd: compression.PowerSGD | None = None
        """PowerSGD's state on this rank (ddp.comm_hook=powersgd), for the checkpoint."""
        if self._ddp is not None:
            hook_state, hook, self.powersgd = compression.make(cfg.ddp, distributed.backend(dist_env))
            self.comm_clock = CommClock.attach(self._ddp, hook_state, hook)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's mean loss, through whatever runs the model on this rank."""
        inputs = dict(batch)
        labels = inputs.pop("labels")
        return mean_loss(self.module(**inputs), labels)

    def sync_gradients(self, now: bool):
        """Context for one micro-batch's forward and backward: gradients are all-reduced only
        when `now` (the step's last micro-batch), so accumulation costs no extra communication."""
        if self.fsdp:  # the reduce-scatter waits for the last micro-batch, as DDP's all-reduce does
            cast("FSDPModule", self.logits.model).set_requires_gradient_sync(now)
        return nullcontext() if now or self._ddp is None else self._ddp.no_sync()

    def gradients_ready(self) -> None:
        """After the last backward, before clipping and the optimizer: dense gradients."""
        if self.sparse_embedding is not None:
            self.sparse_embedding.densify()
