"""The optimizer and its learning-rate schedule, built from train.*."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn


def optimizer(model: nn.Module, train_cfg: DictConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train: under LoRA, its state is the adapters' alone."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                             fused=train_cfg.fused_adamw)


def lr_schedule(opt: torch.optim.Optimizer, train_cfg: DictConfig, max_steps: int,
                last_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over train.warmup_ratio of max_steps, then linear decay to 0 at max_steps;
    at `last_step`, the schedule's value there (a resume)."""
    from transformers import get_linear_schedule_with_warmup

    if last_step:  # a schedule that starts part-way reads each group's starting lr from here
        for group in opt.param_groups:
            group["initial_lr"] = train_cfg.lr
    return get_linear_schedule_with_warmup(opt, round(train_cfg.warmup_ratio * max_steps), max_steps,
                                           last_epoch=last_step - 1)


def reconfigure(opt: torch.optim.Optimizer, train_cfg: DictConfig, max_steps: int,
                step: int) -> torch.optim.lr_scheduler.LambdaLR:
    """After a resume that accepted config changes: the loaded optimizer state holds the lr,
    weight decay and fusion it was saved with, so this run's take effect, and the schedule is
    rebuilt for this run's lr and length, at its value at `step`. Returns the new schedule."""
    for group in opt.param_groups:
        group.update(weight_decay=train_cfg.weight_decay, fused=train_cfg.fused_adamw)
    return lr_schedule(opt, train_cfg, max_steps, last_step=step)
