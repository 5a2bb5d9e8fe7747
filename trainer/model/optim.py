"""The optimizer and its learning-rate schedule, built from train.*."""

from __future__ import annotations

import torch
from torch import nn

from trainer.config.schema import TrainConfig


def decays(name: str, parameter: nn.Parameter, module: nn.Module) -> bool:
    """Whether weight decay applies: not to biases nor to normalization layers' weights (a
    LayerNorm's, an RMSNorm's), as transformers.Trainer and torchtune leave them: they shift
    and scale activations, and pulling them to 0 only fights the norm."""
    return parameter.ndim >= 2 and not name.endswith("bias") and "norm" not in type(module).__name__.lower()


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The parameters that train, with decay and without (`decays`), in the model's order."""
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decaying = [p for name, p in trained if decays(name, p, owner[id(p)])]
    ids = {id(p) for p in decaying}
    groups = [{"params": decaying, "weight_decay": weight_decay, "decays": True},
              {"params": [p for _, p in trained if id(p) not in ids], "weight_decay": 0.0, "decays": False}]
    return [group for group in groups if group["params"]]


def optimizer(model: nn.Module, train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train: under LoRA, its state is the adapters' alone."""
    return torch.optim.AdamW(parameter_groups(model, train_cfg.weight_decay), lr=train_cfg.lr,
                             fused=train_cfg.fused_adamw)


def warmup_steps(train_cfg: TrainConfig, max_steps: int) -> int:
    """train.warmup_steps, else train.warmup_ratio of max_steps."""
    return train_cfg.warmup_steps if train_cfg.warmup_steps is not None else round(train_cfg.warmup_ratio * max_steps)


def lr_schedule(opt: torch.optim.Optimizer, train_cfg: TrainConfig, max_steps: int,
                last_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 (warmup_steps), then train.lr_scheduler: linear decay to 0 at
    max_steps, a cosine to 0, or constant; at `last_step`, the schedule's value there (a
    resume). transformers' own schedules, as its Trainer builds them."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    if last_step:  # a schedule that starts part-way reads each group's starting lr from here
        for group in opt.param_groups:
            group["initial_lr"] = train_cfg.lr
    warmup, last_epoch = warmup_steps(train_cfg, max_steps), last_step - 1
    if train_cfg.lr_scheduler == "constant":
        return get_constant_schedule_with_warmup(opt, warmup, last_epoch=last_epoch)
    schedule = get_cosine_schedule_with_warmup if train_cfg.lr_scheduler == "cosine" else \
        get_linear_schedule_with_warmup
    return schedule(opt, warmup, max_steps, last_epoch=last_epoch)


def reconfigure(opt: torch.optim.Optimizer, train_cfg: TrainConfig, max_steps: int,
                step: int) -> torch.optim.lr_scheduler.LambdaLR:
    """After a resume that accepted config changes: the loaded optimizer state holds the lr,
    weight decay and fusion it was saved with, so this run's take effect, and the schedule is
    rebuilt for this run's lr and length, at its value at `step`. Returns the new schedule."""
    for group in opt.param_groups:
        group.update(weight_decay=train_cfg.weight_decay if group.get("decays", True) else 0.0,
                     fused=train_cfg.fused_adamw)
    return lr_schedule(opt, train_cfg, max_steps, last_step=step)
