"""How each optimizer step's global batch is split over the ranks and into micro-batches: the
arithmetic alone (a leaf: the data, the strategies, the checkpoint and the preflight ask it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.config.schema import TrainConfig
from trainer.errors import ConfigError

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class BatchPlan:
    """How each optimizer step's global batch is split: over the ranks, then into micro-batches.

    The global batch is the run's invariant: the data order, the steps per epoch, the data
    position and the gradient of each step (up to the last bits) depend on it alone. The
    world size and train.batch_size only decide how it is cut.
    """

    global_batch: int
    micro_batch: int
    """Samples per rank per forward pass."""
    grad_accum: int
    """Micro-batches per rank per optimizer step."""

    @classmethod
    def of(cls, train_cfg: TrainConfig, world_size: int, resumed: int | None = None) -> BatchPlan:
        """From train.global_batch, else the resumed checkpoint's global batch (`resumed`: a
        run keeps its global batch), else train.batch_size x grad_accum x world size. With a
        global batch, each rank accumulates the fewest micro-batches of at most
        train.batch_size that split its share evenly."""
        global_batch = train_cfg.global_batch or resumed
        if global_batch is None:
            grad_accum = train_cfg.grad_accum or 1
            return cls(train_cfg.batch_size * grad_accum * world_size, train_cfg.batch_size, grad_accum)
        if global_batch % world_size:
            given = "" if train_cfg.global_batch else " (the resumed checkpoint's)"
            fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0][:12]
            raise ConfigError(
                f"train.global_batch: {global_batch}{given} samples per step cannot be split evenly over world "
                f"size {world_size}; run on a world size that divides it ({', '.join(map(str, fits))}, ...)")
        share = global_batch // world_size
        grad_accum = next(n for n in range(-(-share // train_cfg.batch_size), share + 1) if share % n == 0)
        return cls(global_batch, share // grad_accum, grad_accum)
