"""The optimizer and its schedule (trainer/model/optim.py): weight decay where transformers.Trainer
puts it, and transformers' own schedules."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from support.models import make_tiny_model

from trainer.model import optim

FAMILIES = ["bert", "roberta", "deberta-v2", "modernbert", "gpt2", "llama", "qwen2", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_decay_spares_biases_and_norms_as_transformers_trainer_does(family, tmp_path):
    from transformers import AutoModelForSequenceClassification, Trainer

    model = AutoModelForSequenceClassification.from_pretrained(make_tiny_model(tmp_path, 0.0, family))
    groups = optim.optimizer(model, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.1, "fused_adamw": False})
                             ).param_groups
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for g in groups if g["weight_decay"] == 0.1 for p in g["params"])
    assert decayed == sorted(Trainer.get_decay_parameter_names(None, model))
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert any(name.endswith("bias") or "norm" in name for g in groups if g["weight_decay"] == 0.0
               for name in (names[id(p)] for p in g["params"]))


def schedule_cfg(**changes):
    return OmegaConf.create({"lr": 1.0, "weight_decay": 0.0, "fused_adamw": False, "warmup_ratio": 0.1,
                             "warmup_steps": None, "lr_scheduler": "linear", **changes})


@pytest.mark.parametrize("scheduler, at_five", [("linear", 5 / 7), ("cosine", 0.5 * (1 + torch.cos(torch.tensor(
    torch.pi * 2 / 7)).item())), ("constant", 1.0)])
def test_each_schedule_warms_up_then_follows_its_shape(scheduler, at_five):
    train_cfg = schedule_cfg(lr_scheduler=scheduler, warmup_steps=3)  # not warmup_ratio's 0.1 x 10 = 1
    opt = optim.optimizer(torch.nn.Linear(2, 2), train_cfg)
    schedule = optim.lr_schedule(opt, train_cfg, max_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert lrs[5] == pytest.approx(at_five)
    resumed = optim.lr_schedule(optim.optimizer(torch.nn.Linear(2, 2), train_cfg), train_cfg, 10, last_step=5)
    assert resumed.get_last_lr()[0] == pytest.approx(lrs[5])


def test_warmup_steps_win_over_the_ratio():
    assert optim.warmup_steps(schedule_cfg(warmup_ratio=0.5), 100) == 50
    assert optim.warmup_steps(schedule_cfg(warmup_ratio=0.5, warmup_steps=7), 100) == 7
