"""train.strategy's names, and the class each one stands for. A new strategy (HSDP, tensor
parallel) is a module of its own in trainer/strategies/ and one line here: nothing else in
the trainer asks which strategy runs.

Torch-free, so that a command checks what the strategy asks of the config (`check`, called by
trainer/cli/run_config.py) before torch is imported; each class is imported when it is chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainer.tasks.registry import PAIR_TASKS

if TYPE_CHECKING:
    from trainer.strategies.base import Strategy

STRATEGIES = {
    "ddp": "trainer.strategies.ddp:DDP",
    "fsdp": "trainer.strategies.fsdp:FSDP",
    "dp": "trainer.strategies.dp:DataParallel",
}


def of(cfg: Config) -> Strategy:
    """The strategy train.strategy names, for this run's config (chosen once, then asked)."""
    module, _, name = STRATEGIES[cfg.train.strategy].partition(":")
    return getattr(importlib.import_module(module), name)(cfg)


def check(cfg: Config) -> None:
    """What train.strategy asks of the other keys: a ConfigError naming the first key it refuses."""
    strategy = cfg.train.strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategy: must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if cfg.ddp.comm_hook != "none" and strategy != "ddp":
        raise ConfigError(f"ddp.comm_hook: {cfg.ddp.comm_hook} compresses DDP's all-reduce, and "
                          f"train.strategy={strategy} has none; set ddp.comm_hook=none")
    if cfg.data.packing and strategy == "dp":
        # It scatters each tensor of a batch by its first dimension: a packed batch's rows
        # and its samples are not the same count.
        raise ConfigError("data.packing: nn.DataParallel (train.strategy=dp) splits a batch by rows, and a packed "
                          "row holds several samples; use train.strategy=ddp or set data.packing=false")
    if strategy == "dp" and cfg.data.problem_type in PAIR_TASKS:
        raise ConfigError("train.strategy: dp scatters a batch by rows, and a pair's chosen and rejected rows "
                          "must meet in one loss (data.problem_type=pairwise); use ddp (one process per device)")
