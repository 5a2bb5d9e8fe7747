"""The model: a transformers sequence classifier, and the DDP / DataParallel wrapper around it.

The trainer always keeps the bare model next to the wrapped one. Checkpoints and the
final export are taken from the bare model, so no `module.` (or `_orig_mod.`) prefix ever
reaches a file, whatever the strategy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ConfigError
from trainer.rendezvous import DistEnv


def _load_error(name: str, e: Exception) -> ConfigError:
    message = " ".join(str(e).strip().split("\n")[0].split())[:300]
    return ConfigError(f"model.name: {name}: {type(e).__name__}: {message}")


def load_tokenizer(model_cfg: DictConfig):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_cfg.name)
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg.name, e) from None


def attention_for(model_cfg: DictConfig, device: torch.device) -> str:
    if model_cfg.attn_implementation != "auto":
        return model_cfg.attn_implementation
    return "sdpa" if device.type == "cuda" else "eager"


def load_model(model_cfg: DictConfig, num_labels: int, seed: int, device: torch.device) -> nn.Module:
    """The bare classifier on `device`. Seeded, so the new head is the same in every process and run."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    try:
        config = AutoConfig.from_pretrained(
            model_cfg.name, num_labels=num_labels, attn_implementation=attention_for(model_cfg, device)
        )
        if not model_cfg.pretrained:
            return AutoModelForSequenceClassification.from_config(config).to(device)
        # A classifier fine-tuned before with another label count gets a new head (the
        # load report names it), rather than an error.
        return AutoModelForSequenceClassification.from_pretrained(
            model_cfg.name, config=config, ignore_mismatched_sizes=True
        ).to(device)
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg.name, e) from None


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
    def maybe(cls, model: nn.Module, cfg: DictConfig, device: torch.device) -> "SparseEmbeddingGrad | None":
        embedding = model.get_input_embeddings()
        if cfg.ddp.sparse_embedding_grad and device.type == "cpu" and isinstance(embedding, nn.Embedding):
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


def wrap(model: nn.Module, cfg: DictConfig, dist_env: DistEnv, device: torch.device) -> nn.Module:
    """The module the training step calls: DDP, DataParallel, or the model itself."""
    if cfg.train.strategy == "dp":
        if dist_env.world_size > 1:
            raise ConfigError(
                "train.strategy: dp (nn.DataParallel) runs in one process; launch without torchrun "
                "or with --nproc-per-node=1, or use ddp"
            )
        wrapped: nn.Module = nn.DataParallel(model) if torch.cuda.device_count() > 1 else model
    elif dist_env.is_distributed:
        ddp = cfg.ddp
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=ddp.bucket_cap_mb,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            static_graph=ddp.static_graph,
            # Every parameter of a sequence classifier gets a gradient; searching for unused
            # ones costs a graph traversal per step.
            find_unused_parameters=False,
            # Buffers (position ids) never change: no broadcast before each forward.
            **{_FORWARD_SYNC_BUFFERS: False},
        )
    else:
        wrapped = model
    if cfg.train.compile:
        wrapped = torch.compile(wrapped)
    return wrapped


@dataclass(frozen=True)
class FlopModel:
    """Training FLOPs of a transformer encoder, counted on real (unpadded) tokens.

    Per token: 6 x the parameters of the linear layers (forward 2, backward 4). Per
    sequence of length s, attention scores and the weighted sum add 12 x layers x hidden x s^2.
    Embedding lookups do no matmul work, so 6 x all parameters would overcount by ~2x.
    """

    linear_params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model: nn.Module) -> "FlopModel":
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        config = model.config
        return cls(linear, config.num_hidden_layers, config.hidden_size)

    def train_flops(self, tokens: int, sum_squared_lengths: int) -> float:
        return 6.0 * self.linear_params * tokens + 12.0 * self.layers * self.hidden * sum_squared_lengths
