"""When the loop logs, evaluates, saves and stops.

Every rank must take the same decision at the same step, because each decision enters
collectives (the log all-reduce, eval's totals, the checkpoint gather). So a decision may
depend only on the step and on flags the ranks have already agreed on (the preemption
flag), never on anything rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class Policy:
    max_steps: int
    log_every: int
    eval_every: int
    """0: evaluate only at the end."""
    save_every: int
    """0: save only at the end."""

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "Policy":
        train = cfg.train
        return cls(train.max_steps, train.log_every, train.eval_every, cfg.checkpoint.every)

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def evaluate(self, step: int) -> bool:
        """An eval during training; the final one always runs, after the loop."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.max_steps

    def save(self, step: int) -> bool:
        return (bool(self.save_every) and step % self.save_every == 0) or step == self.max_steps

    def stop_early(self, step: int, preempted_by: str | None) -> bool:
        """Stop before max_steps: the ranks agreed that one of them got a preemption signal."""
        return preempted_by is not None and step < self.max_steps
