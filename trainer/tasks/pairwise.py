"""data.problem_type=pairwise: a reward model, trained on preference pairs.

The model is a sequence classifier with one output, the reward of a text. A sample is a pair:
a chosen answer and a rejected one (after the same prompt), which run through the model in
one forward, chosen rows first (trainer/data/loaders.py's `PairCollate`); `per_sample` gives
each pair's two rewards side by side. The loss is Bradley-Terry's, -log sigmoid(chosen -
rejected - margin), with an optional margin per pair (Llama 2) and train.center_rewards's
(chosen + rejected)^2 (arXiv 2312.09244).

Metrics, from every pair gathered on rank 0 in the split's row order, so that they do not
depend on the world size:
- accuracy: the share of pairs whose chosen reward is above the rejected one; a tie counts
  wrong, as RewardBench counts it;
- margin: the mean of chosen - rejected; reward_mean and reward_std, over both sides;
- length_baseline: the accuracy of "prefer the longer answer" (in tokens, as the model reads
  them; a tie counts wrong) on the same pairs. Beside accuracy, it says how much of it a
  length bias alone would give.

`evaluate` adds the accuracy on the pairs whose chosen answer is the longer and on those
where it is the shorter, and draws the margins; `score` writes each text's reward
(trainer/scoring/), `evaluate`'s rows file each pair's two rewards and which is preferred.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.config.schema import DataConfig, TrainConfig
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import Tally, Task, figure, save
from trainer.tasks.space import Labels

MARGIN, CHOSEN_TOKENS, REJECTED_TOKENS = range(3)
"""The columns of a pair's labels, as PairCollate stacks them: its margin (0 without
data.margin_field) and the tokens of each side."""


class Pairs(Tally):
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.rewards: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> None:
        self.rows += rows
        self.rewards.append(logits.detach().double().cpu())
        self.labels.append(labels.detach().double().cpu())

    def finish(self, dist_env: DistEnv) -> tuple[dict[str, float], dict[str, Any]]:
        mine = (np.asarray(self.rows, dtype=np.int64),
                torch.cat(self.rewards).numpy() if self.rewards else np.zeros((0, 2)),
                torch.cat(self.labels).numpy() if self.labels else np.zeros((0, 3)))
        shards = distributed.gather_to_rank_zero(dist_env, mine)
        metrics: dict[str, float] | None = None
        pairs = None
        if shards is not None:  # rank 0
            order = np.argsort(np.concatenate([shard[0] for shard in shards]), kind="stable")
            rewards = np.concatenate([shard[1] for shard in shards])[order]
            labels = np.concatenate([shard[2] for shard in shards])[order]
            pairs = (rewards, labels)
            metrics = pair_metrics(rewards, labels)
        metrics = distributed.broadcast_from_rank_zero(dist_env, metrics)
        return metrics, {"pairs": pairs}


def pair_metrics(rewards: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The metrics of pairs' (chosen, rejected) rewards and their labels (`MARGIN`, ...)."""
    if not len(rewards):
        return {"accuracy": 0.0, "margin": 0.0, "reward_mean": 0.0, "reward_std": 0.0, "length_baseline": 0.0}
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {"accuracy": float((chosen > rejected).mean()),
            "margin": float((chosen - rejected).mean()),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "length_baseline": float((labels[:, CHOSEN_TOKENS] > labels[:, REJECTED_TOKENS]).mean())}


class Pairwise(Task):
    name = "pairwise"
    hf_problem_type = "regression"
    """One number and no activation: a transformers pipeline on final/ (function_to_apply
    none) and RewardBench's `logits[:, 0]` both read the reward itself."""
    main_metrics = (("accuracy", "accuracy"), ("length_baseline", "longer-answer baseline"))
    pairs = True
    keeps_dropout = False
    """The loss reads a pair's difference: independent masks on its two sides would blur it."""

    def __init__(self, labels: Labels, data_cfg: DataConfig, train_cfg: TrainConfig | None = None):
        super().__init__(labels, data_cfg, train_cfg)
        self.center = float(train_cfg.center_rewards) if train_cfg is not None else 0.0

    def per_sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's (2 x pairs, 1) rewards, chosen rows first, as (pairs, 2): each pair's
        chosen and rejected reward."""
        return logits.view(2, -1).T

    def sample_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rewards = logits.float()
        difference = rewards[:, 0] - rewards[:, 1] - labels[:, MARGIN].float()
        losses = -F.logsigmoid(difference)
        if self.center:
            losses = losses + self.center * rewards.sum(-1).square()
        return losses

    def unlearnt(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The reward head's bias, unless train.center_rewards gives it a gradient.

        It adds the same to a pair's two rewards, so the loss has no gradient in it: what
        reaches it is the rounding of a sum of +g and -g over the batch's rows. AdamW divides
        a gradient by its own size, so that rounding would move the bias by about lr every
        step, its sign set by the order of the sum: the bias would drift at random, and 2
        ranks (two partial sums, then an all-reduce) apart from 1 process, by 4.5e-4 in 12
        steps of the tiny e2e run. Left out, it keeps its initial value."""
        if self.center:
            return []
        heads = [module for module in model.modules()
                 if isinstance(module, torch.nn.Linear) and module.out_features == 1]
        biases = [getattr(head, "bias", None) for head in heads]
        return [bias for bias in biases if bias is not None and bias.requires_grad]

    def dummy_labels(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(rows, 3, device=device)

    def tally(self, device: torch.device) -> Tally:
        return Pairs()

    def report(self, details: dict[str, Any]) -> dict[str, Any]:
        rewards, labels = details["pairs"]
        chosen_longer = labels[:, CHOSEN_TOKENS] > labels[:, REJECTED_TOKENS]
        chosen_shorter = labels[:, CHOSEN_TOKENS] < labels[:, REJECTED_TOKENS]
        right = rewards[:, 0] > rewards[:, 1]

        def share(where: np.ndarray) -> dict[str, Any]:
            return {"pairs": int(where.sum()), "accuracy": float(right[where].mean()) if where.any() else None}

        return {"ties": int((rewards[:, 0] == rewards[:, 1]).sum()),
                "chosen_longer": share(chosen_longer), "chosen_shorter": share(chosen_shorter),
                "same_length": share(~chosen_longer & ~chosen_shorter),
                "rewards": {"chosen_mean": float(rewards[:, 0].mean()), "rejected_mean": float(rewards[:, 1].mean()),
                            "std": float(rewards.std())}}

    def format_report(self, report: dict[str, Any]) -> list[str]:
        lines = [f"pairs whose chosen answer is {words:<9} {report[key]['pairs']:7d}" + (
            "" if report[key]["accuracy"] is None else f"  accuracy {report[key]['accuracy']:.4f}")
            for key, words in (("chosen_longer", "longer"), ("chosen_shorter", "shorter"),
                               ("same_length", "as long"))]
        rewards = report["rewards"]
        return [*lines, f"ties (counted wrong)                {report['ties']:7d}",
                (f"rewards: chosen mean {rewards['chosen_mean']:.4f}, rejected mean {rewards['rejected_mean']:.4f}, "
                f"std {rewards['std']:.4f}")]

    def plot(self, details: dict[str, Any], title: str, path: Path) -> None:
        rewards, _ = details["pairs"]
        fig, ax = figure(6, 4)
        ax.hist(rewards[:, 0] - rewards[:, 1], bins=40)
        ax.axvline(0, color="grey", linewidth=1)
        ax.set(xlabel="chosen reward - rejected reward", ylabel="pairs", title=title)
        save(fig, path)

    def predictions(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        """Each text's reward (`score`: one output per text), or each pair's two and which is
        preferred (`evaluate`'s rows: `per_sample`'s pairs)."""
        if logits.shape[-1] == 1:
            return [{"reward": reward} for reward in logits.squeeze(-1).tolist()]
        return [{"chosen_reward": chosen, "rejected_reward": rejected,
                 "preferred": "chosen" if chosen > rejected else "rejected" if rejected > chosen else "tie"}
                for chosen, rejected in logits.tolist()]

    def csv_header(self) -> list[str]:
        return ["chosen_reward", "rejected_reward", "preferred"]

    def csv_row(self, prediction: dict[str, Any]) -> list:
        """A pair's prediction as `evaluate`'s rows file writes it."""
        return [repr(prediction["chosen_reward"]), repr(prediction["rejected_reward"]), prediction["preferred"]]

    def truth(self, labels: torch.Tensor) -> list:
        """The chosen answer is the preferred one: the rows file's `true` is each pair's margin."""
        return [repr(value) for value in labels[:, MARGIN].double().tolist()]
