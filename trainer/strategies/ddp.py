"""train.strategy=ddp: DistributedDataParallel, one process per device, each with the whole
model, the gradients all-reduced in buckets while backward still runs.

Beside DDP itself: the gradient compression wired into its all-reduce (`ddp.comm_hook`,
trainer/strategies/compression.py), the comm clock that measures the communication backward did not
hide, and on CPU the input embedding's gradient as sparse rows. Without a process group (one
plain process) the model runs as it is.
"""

from __future__ import annotations

import inspect
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config.schema import Config, DDPConfig
from trainer.runtime import distributed
from trainer.strategies import compression
from trainer.strategies.base import Strategy
from trainer.strategies.traffic import MIB, Bucket, Param, Traffic, powersgd_elements, ready_fractions

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.stateful import Stateful
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
    def maybe(cls, model: PreTrainedModel, cfg: Config, device: torch.device) -> SparseEmbeddingGrad | None:
        embedding = model.get_input_embeddings()
        if (cfg.ddp.sparse_embedding_grad and device.type == "cpu"
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

    def discard(self) -> None:
        """Clipping by a NaN norm made every row NaN, not just the rows written."""
        self.dense.zero_()
        self.written_rows = self.written_rows[:0]


# torch 2.13 renamed DDP's broadcast_buffers (now deprecated, with a warning) to
# forward_sync_buffers; images built on an earlier torch know only the old name.
_FORWARD_SYNC_BUFFERS = next(name for name in ("forward_sync_buffers", "broadcast_buffers")
                             if name in inspect.signature(DistributedDataParallel).parameters)


def ddp_wrap(model: nn.Module, ddp_cfg: DDPConfig, device: torch.device,
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


class BucketClock:
    """A DDP comm hook: ddp.comm_hook's (trainer/strategies/compression.py), noting when each bucket
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
    def attach(cls, ddp: torch.nn.parallel.DistributedDataParallel, hook_state, hook) -> BucketClock:
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


class DDP(Strategy):
    name = "ddp"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.sparse_embedding: SparseEmbeddingGrad | None = None
        self.ddp: DistributedDataParallel | None = None
        self.powersgd: compression.PowerSGD | None = None
        """PowerSGD's state on this rank (ddp.comm_hook=powersgd), for the checkpoint."""

    def gradient_copies(self) -> int:
        return 1 if self.cfg.ddp.gradient_as_bucket_view else 2  # DDP's buckets hold a second copy

    def traffic(self, params: list[Param], backend: str, sparse_rows: float, bucket_cap_mb: float | None = None,
                comm_hook: str | None = None) -> Traffic:
        """What one DDP step puts on the wire per rank, bucket by bucket, under ddp.* and LoRA
        (already in `params`), or the given bucket size and hook. `sparse_rows`: the embedding
        rows a micro-batch touches, where its gradient goes sparse (ddp.sparse_embedding_grad,
        on gloo)."""
        hook = comm_hook or self.cfg.ddp.comm_hook
        cap = (bucket_cap_mb or self.cfg.ddp.bucket_cap_mb) * MIB
        ready = dict(zip((p.name for p in params), ready_fractions(params), strict=True))
        trained = [p for p in params if p.trained]
        buckets: list[Bucket] = []
        if backend == "gloo" and self.cfg.ddp.sparse_embedding_grad:
            for p in [p for p in trained if p.input_embedding]:
                row_bytes = p.numel // p.shape[0] * p.element_size + 8  # its values and an int64 index
                buckets.append(Bucket(sparse_rows * row_bytes, 1.0, sparse=True))
                trained.remove(p)

        powersgd = hook == "powersgd"
        # DDP rebuilds its buckets after the first step, in the order gradients became ready;
        # under PowerSGD it keeps the first ones, cut in definition order (`wrap`).
        position = {p.name: i for i, p in enumerate(params)}

        def ready_order(p: Param) -> tuple:  # ties as autograd breaks them: later-defined first, lookups last
            return ready[p.name], p.lookup, position[p.name] if p.lookup else -position[p.name]

        order = trained if powersgd else sorted(trained, key=ready_order)
        groups: list[list[Param]] = [[]]
        size = 0
        for p in order:
            groups[-1].append(p)
            size += p.numel * p.element_size
            if size >= cap:
                groups.append([])
                size = 0
        for group in filter(None, groups):
            when = max(ready[p.name] for p in group)
            if powersgd:
                elements = sum(powersgd_elements(p, self.cfg.ddp.powersgd_rank) for p in group)
                buckets.append(Bucket(4.0 * elements, when, collectives=3))  # the plain ones, P, then Q
            elif hook in ("bf16", "fp16"):
                buckets.append(Bucket(2.0 * sum(p.numel for p in group), when))
            else:
                buckets.append(Bucket(float(sum(p.numel * p.element_size for p in group)), when))
        buckets.sort(key=lambda b: b.ready)
        return Traffic(buckets, overlapped=not (powersgd and backend == "gloo"))

    def prepare(self, model, dist_env, device, amp_dtype) -> None:
        # Before DDP is built: DDP reads `sparse` to put the embedding's gradient in its own bucket.
        self.sparse_embedding = SparseEmbeddingGrad.maybe(model, self.cfg, device)

    def wrap(self, logits, dist_env, device, group) -> nn.Module:
        if not dist_env.is_distributed:
            return logits
        self.ddp = ddp_wrap(logits, self.cfg.ddp, device, group)
        hook_state, hook, self.powersgd = compression.make(self.cfg.ddp, distributed.backend(dist_env), group)
        self.comm_clock = BucketClock.attach(self.ddp, hook_state, hook)
        return self.ddp

    def sync_gradients(self, now: bool) -> AbstractContextManager:
        return nullcontext() if now or self.ddp is None else self.ddp.no_sync()

    def gradients_ready(self) -> None:
        if self.sparse_embedding is not None:  # dense again, for clipping and the fused AdamW
            self.sparse_embedding.densify()

    def discard_gradients(self) -> None:
        if self.sparse_embedding is not None:
            self.sparse_embedding.discard()
        if self.powersgd is not None:
            self.powersgd.discard()

    def states(self) -> dict[str, Stateful]:
        return {} if self.powersgd is None else {"comm_hook": self.powersgd}  # each rank's own
