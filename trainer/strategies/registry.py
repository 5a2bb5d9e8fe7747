"""train.strategy's names, and the class each one stands for. A new strategy (HSDP, tensor
parallel) is a module of its own in trainer/strategies/ and one line here: nothing else in
the trainer asks which strategy runs.

Torch-free, so that the config can check the name before torch is imported; each class is
imported when it is chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from trainer.strategies.base import Strategy

STRATEGIES = {
    "ddp": "trainer.strategies.ddp:DDP",
    "fsdp": "trainer.strategies.fsdp:FSDP",
    "dp": "trainer.strategies.dp:DataParallel",
}


def of(cfg: DictConfig) -> Strategy:
    """The strategy train.strategy names, for this run's config (chosen once, then asked)."""
    module, _, name = STRATEGIES[cfg.train.strategy].partition(":")
    return getattr(importlib.import_module(module), name)(cfg)
