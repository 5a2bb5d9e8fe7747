"""train.strategy=dp: nn.DataParallel, one process driving every GPU of its node.

Each replica runs in a thread of its own and the logits are gathered onto the first GPU,
where the loss is taken over the whole batch (trainer/train/step.py says why autocast is entered
inside each replica). One process only: a torchrun world of more is refused before the
rendezvous.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.strategies.base import Strategy


class DataParallel(Strategy):
    name = "dp"
    forecast_unsupported = "the forecast models DDP, not train.strategy=dp (docs/forecast.md)"

    def check_world_size(self, world_size: int) -> None:
        if world_size > 1:
            raise ConfigError("train.strategy: dp (nn.DataParallel) runs in one process; launch without torchrun "
                              "or with --nproc-per-node=1, or use ddp")
        super().check_world_size(world_size)

    def wrap(self, logits, dist_env, device, group) -> nn.Module:
        return nn.DataParallel(logits) if torch.cuda.device_count() > 1 else logits
