"""One way to build a run: the model, the strategy that runs it across ranks and the training
step, from the config.

Training (trainer/train/loop.py), doctor's forecast (trainer/preflight/forecast.py), `evaluate` and
`score`, the memory plan (on the meta device, trainer/preflight/memory.py) and the
benchmarks all build here, so each runs the model and the step that training runs; what
differs is an argument (a process group of one, the meta device, a trained folder).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from omegaconf import DictConfig

from trainer.checkpoint.checkpointer import load_weights
from trainer.checkpoint.store import read_state
from trainer.config.schema import Config, ModelConfig, node
from trainer.data import labels as labels_module
from trainer.data import loaders
from trainer.errors import ConfigError
from trainer.faults.numerics import LossGuard
from trainer.model import lora, optim, pretrained
from trainer.runtime import devices, distributed
from trainer.runtime.environment import DistEnv
from trainer.strategies import registry
from trainer.strategies.base import LogitsUnderAutocast
from trainer.tasks import registry as tasks
from trainer.tasks.space import Labels
from trainer.train.step import TrainStep

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import PretrainedConfig, PreTrainedModel

    from trainer.strategies.base import Strategy
    from trainer.tasks.base import Task


@dataclass
class Model:
    model: PreTrainedModel
    """The model that trains, unwrapped: the transformers model, or peft's around it under
    LoRA. Checkpoints, evaluation and the export read it."""
    tokenizer: Any
    """Its tokenizer (None for a plan on the meta device of a folder that has none)."""
    config: PretrainedConfig
    amp_dtype: torch.dtype
    """The autocast dtype the run computes in (float32: none)."""


PREFETCHED = ("transformers", "torch._dynamo", "transformers.modeling_utils")
"""What `load` imports whatever the model, ~2 s of CPU: transformers' PreTrainedModel, and
torch._dynamo, which transformers imports with it (as torch.optim's step and DDP do). A rank
imports them while it waits for local rank 0's data (Trainer, startup.Prefetch)."""


def tokenizer(cfg: Config, dist_env: DistEnv):
    """model.name's tokenizer alone, before the model: what reading the data needs of it (a
    task of pairs finds the pairs that truncation makes the same: trainer/data/pairs.py)."""
    first = (distributed.local_rank_zero_first(dist_env, f"model.name: {cfg.model.name}")
             if pretrained.from_hub(cfg.model) else nullcontext())
    with first:
        return pretrained.load_tokenizer(cfg.model)


def load(cfg: Config, dist_env: DistEnv, device: torch.device, amp_dtype: torch.dtype, labels: Labels, *,
         on_meta: bool = False, trained: Path | None = None, backward: bool = True, tokenizer=None) -> Model:
    """model.name's classifier for `labels` as training builds it: its tokenizer,
    data.max_length checked against its positions before any weight loads, the weights (frozen
    ones in model.dtype), LoRA's adapters, activation checkpointing, in train mode.

    `on_meta`: shapes and dtypes only, no weights read, for the memory plan on `device`'s
    kind (a folder with config.json alone will do). `trained`: a `resume.trained_folder`, in
    eval mode: final/ (its own architecture, tokenizer and label names, the adapters merged),
    or a checkpoint step-N, whose weights go into model.name's architecture. `backward`: False
    for a model that only runs forward (its attention: pretrained.attention_for). `tokenizer`:
    model.name's, loaded already (`tokenizer`)."""
    model_cfg, merged = cfg.model, trained is not None and pretrained.is_model_folder(trained)
    if merged:  # final/: a folder of its own, whatever revision of model.name it was trained from
        model_cfg = cast(ModelConfig, DictConfig({**node(cfg.model), "name": str(trained), "pretrained": True,
                                                  "revision": None}))
    if model_cfg.trust_remote_code and dist_env.is_rank_zero:
        log.warning("model.trust_remote_code: %s runs the modeling code its repository ships", model_cfg.name)
    # One download per node: local rank 0 fetches a hub model into the HF cache (shared by
    # the node's ranks, or by every node on a PVC), the others then read it from there.
    from_hub = pretrained.from_hub(model_cfg) and not on_meta
    first = distributed.local_rank_zero_first(dist_env, f"model.name: {model_cfg.name}") if from_hub else nullcontext()
    with first:
        if tokenizer is None and (not on_meta or pretrained.has_tokenizer(model_cfg)):
            tokenizer = pretrained.load_tokenizer(model_cfg)
        pad_token_id = None if tokenizer is None else tokenizer.pad_token_id
        config = pretrained.load_config(model_cfg, labels, device.type, pad_token_id, backward)
        # Before the weights: for an 8B model a mistake costs seconds, not minutes.
        pretrained.check_max_length(model_cfg, cfg.data.max_length, config, tokenizer)
        dtype = lora.frozen_dtype(cfg.model, amp_dtype)
        bare = pretrained.meta_model(config, dtype, model_cfg.trust_remote_code) if on_meta else \
            pretrained.load_model(model_cfg, config, cfg.seed, device, dtype)
    if trained is None and not keeps_dropout(cfg, labels):  # before LoRA's, which model.lora.dropout sets
        pretrained.without_dropout(bare)
        if dist_env.is_rank_zero:
            log.info("model.dropout: off while training (%s)", "model.dropout=false" if cfg.model.dropout is False
                     else f"data.problem_type={labels.problem_type} trains without")
    built = bare if merged else lora.apply(bare, cfg.model)  # final/ has the adapters merged in already
    if trained is not None:
        if not merged:  # a checkpoint of a LoRA run holds the adapters
            load_weights(trained, built)
        return Model(built.eval(), tokenizer, config, amp_dtype)
    if cfg.model.gradient_checkpointing and not on_meta:
        pretrained.use_gradient_checkpointing(built)
    return Model(built.train(), tokenizer, config, amp_dtype)  # from_pretrained returns eval mode: no dropout


def keeps_dropout(cfg: Config, labels: Labels) -> bool:
    """model.dropout, or where it is null what the task asks (a reward model trains without)."""
    setting = cfg.model.dropout
    return tasks.task_class(labels.problem_type).keeps_dropout if setting is None else setting


@dataclass
class Built(Model):
    strategy: Strategy
    """How the model runs across the ranks."""
    logits: LogitsUnderAutocast
    """The model's logits in the run's precision, unwrapped: what evaluation calls (the step
    calls what the strategy wrapped them in)."""
    step: TrainStep
    """The training step, with the optimizer, the LR schedule and the loss scaler it steps."""
    task: Task
    """The loss, the metrics and the predictions of data.problem_type."""

    def states(self, train: Stateful) -> dict[str, Stateful]:
        """What a checkpoint holds, by name, with `train` the train state (trainer/checkpoint/)."""
        step = self.step
        return {"model": self.model, "optimizer": step.optimizer, "scheduler": step.scheduler,
                "scaler": step.scaler, "train": train, **self.strategy.states()}


def build(cfg: Config, dist_env: DistEnv, device: torch.device, labels: Labels, *, max_steps: int,
          group: ProcessGroup | None = None, strategy: Strategy | None = None, tokenizer=None) -> Built:
    """The model for `labels`, parallelized by the run's strategy over `group` (None: every
    rank), and the step that trains it for `max_steps` steps (the LR schedule's length).
    `tokenizer`: model.name's, where the caller loaded it already."""
    amp_dtype = devices.configure_compute(cfg.train, dist_env, device)
    loaded = load(cfg, dist_env, device, amp_dtype, labels, tokenizer=tokenizer)
    strategy = strategy or registry.of(cfg)
    if pretrained.compiles(cfg.train.compile, device, max_steps):  # before FSDP2 wraps the blocks, as torchtitan
        pretrained.compile_blocks(loaded.model)
    parallel = strategy.parallelize(loaded.model, dist_env, device, amp_dtype, group)
    # After the strategy: FSDP2 has made the parameters the optimizer holds into shards.
    optimizer = optim.optimizer(loaded.model, cfg.train)
    scheduler = optim.lr_schedule(optimizer, cfg.train, max_steps)
    # fp16 only: gradients too small for fp16 would flush to zero unless the loss is scaled
    # up first. A no-op (scale 1, an empty state) for fp32 and bf16.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    task = tasks.of(labels, cfg.data, cfg.train)
    guard = LossGuard(cfg.fault, dist_env, group)
    step = TrainStep(loaded.model, strategy, parallel.module, task, optimizer, scheduler, scaler, guard,
                     cfg.train.max_grad_norm, device, non_blocking=loaders.pins_memory(cfg, device),
                     sdpa_backend=cfg.model.sdpa_backend, recomputes=cfg.model.gradient_checkpointing)
    return Built(loaded.model, loaded.tokenizer, loaded.config, amp_dtype, strategy, parallel.logits, step, task)


@dataclass
class Trained(Model):
    logits: torch.nn.Module
    """The model's logits in the run's precision."""
    task: Task
    """The task of the labels it was trained on."""


def trained(cfg: Config, dist_env: DistEnv, device: torch.device, folder: Path, exact: bool = True) -> Trained:
    """A trained model (`load`'s `trained`) for evaluate and score, with the label space it
    was trained on: final/'s config holds it, a checkpoint's state.json, or (a checkpoint of
    an older run) the config. `exact`: its attention as in training, so that evaluate's
    metrics are training's; score, bound to no earlier figure, takes the fastest forward."""
    if pretrained.is_model_folder(folder):
        from transformers import AutoConfig

        labels = pretrained.labels_of(AutoConfig.from_pretrained(folder))
    else:
        saved = read_state(folder).get("labels")
        found = Labels.from_state(saved) if saved else labels_module.from_config(cfg.data)
        if found is None:
            raise ConfigError(f"checkpoint: {folder} does not say its labels (an older run's): set data.num_labels")
        labels = found
    loaded = load(cfg, dist_env, device, devices.configure_compute(cfg.train, dist_env, device), labels,
                  trained=folder, backward=exact)
    return Trained(**vars(loaded), logits=LogitsUnderAutocast(loaded.model, device.type, loaded.amp_dtype),
                   task=tasks.of(labels, cfg.data, cfg.train))
