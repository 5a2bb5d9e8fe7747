"""trainer/optim.py's LR schedules are transformers' own, step for step, bit for bit: they are
copied, not imported (transformers.optimization imports peft, in every rank of every run)."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf

from trainer import optim

SCHEDULES = ["linear", "cosine", "constant"]


def transformers_schedule(opt: torch.optim.Optimizer, scheduler: str, warmup: int, max_steps: int,
                          last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    if scheduler == "constant":
        return get_constant_schedule_with_warmup(opt, warmup, last_epoch=last_epoch)
    made = get_cosine_schedule_with_warmup if scheduler == "cosine" else get_linear_schedule_with_warmup
    return made(opt, warmup, max_steps, last_epoch=last_epoch)


def train_cfg(scheduler: str, warmup: int):
    return OmegaConf.create({"lr": 3e-4, "weight_decay": 0.0, "fused_adamw": False, "warmup_ratio": 0.0,
                             "warmup_steps": warmup, "lr_scheduler": scheduler})


def lrs(schedule: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return seen


@pytest.mark.parametrize("scheduler", SCHEDULES)
@pytest.mark.parametrize("warmup, max_steps", [(0, 1), (0, 17), (1, 1), (3, 10), (7, 7), (5, 1000), (12, 10)])
def test_each_schedule_is_transformers_own_bit_for_bit(scheduler, warmup, max_steps):
    cfg = train_cfg(scheduler, warmup)
    ours = optim.lr_schedule(optim.optimizer(torch.nn.Linear(2, 2), cfg), cfg, max_steps)
    theirs = transformers_schedule(optim.optimizer(torch.nn.Linear(2, 2), cfg), scheduler, warmup, max_steps)
    assert lrs(ours, max_steps + 3) == lrs(theirs, max_steps + 3)  # exact: the same floats
    assert ours.state_dict() == theirs.state_dict()  # a checkpoint of either resumes the other


@pytest.mark.parametrize("scheduler", SCHEDULES)
def test_a_resumed_schedule_is_transformers_own(scheduler):
    cfg = train_cfg(scheduler, 3)
    ours = optim.lr_schedule(optim.optimizer(torch.nn.Linear(2, 2), cfg), cfg, 20, last_step=6)
    opt = optim.optimizer(torch.nn.Linear(2, 2), cfg)
    for group in opt.param_groups:
        group["initial_lr"] = cfg.lr
    theirs = transformers_schedule(opt, scheduler, 3, 20, last_epoch=5)
    assert lrs(ours, 16) == lrs(theirs, 16)


def test_building_a_schedule_imports_neither_transformers_optimization_nor_peft(tmp_path):
    """In a fresh interpreter: the point of the copy."""
    import subprocess

    code = ("import sys, torch; from omegaconf import OmegaConf; from trainer import optim; "
            "cfg = OmegaConf.create({'lr': 1e-3, 'weight_decay': 0.0, 'fused_adamw': False, 'warmup_ratio': 0.1, "
            "'warmup_steps': None, 'lr_scheduler': 'cosine'}); "
            "optim.lr_schedule(optim.optimizer(torch.nn.Linear(2, 2), cfg), cfg, 10); "
            "print(sorted(m for m in ('peft', 'transformers.optimization', 'transformers.trainer_utils') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"
