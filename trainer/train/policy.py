"""When the loop logs, evaluates, saves and stops, and which checkpoint is the best.

Every rank must take the same decision at the same step, because each decision enters
collectives (the log all-reduce, eval's totals, the checkpoint gather). So a decision may
depend only on the step, on flags the ranks have already agreed on (the preemption flag),
and on eval results every rank holds bit for bit (rank 0's, broadcast), never on anything
rank-local.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Literal, cast

from trainer.config.schema import Config

log = logging.getLogger(__name__)

Interval = int | Literal["epoch"]
"""A step count (0: never during the run) or "epoch": at the end of each epoch."""


@dataclass(frozen=True)
class Policy:
    max_steps: int
    """train.max_steps, or train.epochs x steps_per_epoch."""
    steps_per_epoch: int
    log_every: int
    eval_every: Interval
    """0: evaluate only at the end."""
    save_every: Interval
    """0: save only at the end."""
    save_at_every_eval: bool
    """With a best_metric: the best checkpoint must exist, whichever eval turns out best."""

    @classmethod
    def from_config(cls, cfg: Config, steps_per_epoch: int) -> Policy:
        train = cfg.train
        if train.max_steps is not None:
            max_steps = train.max_steps
        else:
            assert train.epochs is not None, "the config sets one of train.max_steps and train.epochs"
            max_steps = train.epochs * steps_per_epoch
        # An interval's check (schema.STEPS_OR_EPOCH) leaves a step count or "epoch".
        every = cast(Interval, train.eval_every), cast(Interval, cfg.checkpoint.every)
        return cls(max_steps, steps_per_epoch, train.log_every, *every,
                   cfg.checkpoint.best_metric is not None)

    def _due(self, every: Interval, step: int) -> bool:
        if every == "epoch":
            return step % self.steps_per_epoch == 0
        return bool(every) and step % every == 0

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def evaluate(self, step: int) -> bool:
        """An eval during training; the final one always runs, after the loop."""
        return self._due(self.eval_every, step) and step < self.max_steps

    def save(self, step: int) -> bool:
        return (self._due(self.save_every, step) or step == self.max_steps
                or (self.save_at_every_eval and self.evaluate(step)))

    def stop_for_preemption(self, step: int, preempted_by: str | None) -> bool:
        """Stop before max_steps: the ranks agreed that one of them got a preemption signal."""
        return preempted_by is not None and step < self.max_steps


@dataclass
class Selection:
    """The best evaluated step by checkpoint.best_metric, and early stopping's patience.

    As HF's Trainer does: a step is the new best only if strictly better than the best so
    far (ties stay with the earlier step); patience counts evaluations that did not beat the
    best so far by more than the threshold. Its state is saved in every checkpoint, so a
    resumed run makes the same choices as an uninterrupted one.
    """

    metric: str | None
    """Any validation metric of the task (trainer/tasks/registry.py); None: no selection (and
    no early stopping)."""
    higher_is_better: bool = True
    patience: int = 0
    threshold: float = 0.0
    # the state
    step: int | None = None
    value: float | None = None
    eval: dict | None = None
    """The best step's validation metrics."""
    evals_without_improvement: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Selection:
        ckpt, train = cfg.checkpoint, cfg.train
        return cls(ckpt.best_metric, ckpt.best_mode != "min", train.early_stopping_patience,
                   train.early_stopping_threshold)

    def observe(self, step: int, results: dict) -> None:
        """An evaluation's results, the same on every rank."""
        if self.metric is None:
            return
        value = results[self.metric]
        gain = (value - self.value if self.higher_is_better else self.value - value) if self.value is not None \
            else float("inf")
        self.evals_without_improvement = 0 if gain > self.threshold else self.evals_without_improvement + 1
        if gain > 0:
            self.step, self.value, self.eval = step, value, dict(results)
            log.info("best so far: step %d, %s %.6g", step, self.metric, value)

    @property
    def stop(self) -> bool:
        """Early stopping: `patience` evaluations in a row without an improvement."""
        return self.patience > 0 and self.evals_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in ("step", "value", "eval", "evals_without_improvement")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def summary(self) -> dict | None:
        if self.step is None:
            return None
        return {"step": self.step, "metric": self.metric, "value": self.value, "eval": self.eval}
