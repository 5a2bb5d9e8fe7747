"""data.problem_type=regression: one number per row (a score, a rating, STS-B's similarity).

One output, mean squared error. Metrics: MSE and MAE from sums over the ranks; Pearson's and
Spearman's correlation (average ranks for ties) from every row's prediction, gathered on rank
0 in the split's row order, so that they do not depend on the world size. `evaluate` draws
the predictions against the truth; `score` writes each row's value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import Tally, Task, figure, save


class Pairs(Tally):
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.predicted: list[float] = []
        self.truth: list[float] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> None:
        self.rows += rows
        self.predicted += logits.squeeze(-1).double().tolist()
        self.truth += labels.double().tolist()

    def finish(self, dist_env: DistEnv) -> tuple[dict[str, float], dict[str, Any]]:
        shards = distributed.gather_to_rank_zero(dist_env, (self.rows, self.predicted, self.truth))
        metrics: dict[str, float] | None = None
        pairs = None
        if shards is not None:  # rank 0
            rows = np.concatenate([np.asarray(shard[0], dtype=np.int64) for shard in shards])
            order = np.argsort(rows, kind="stable")
            predicted = np.concatenate([np.asarray(shard[1]) for shard in shards])[order]
            truth = np.concatenate([np.asarray(shard[2]) for shard in shards])[order]
            metrics, pairs = regression_metrics(predicted, truth), (predicted, truth)
        metrics = distributed.broadcast_from_rank_zero(dist_env, metrics)
        return metrics, {"pairs": pairs}


def _correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r, 0 where either side is constant."""
    x, y = x - x.mean(), y - y.mean()
    scale = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / scale) if scale > 0 else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average (scipy.stats.rankdata's default)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def regression_metrics(predicted: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    error = predicted - truth
    return {"mse": float((error * error).mean()) if len(error) else 0.0,
            "mae": float(np.abs(error).mean()) if len(error) else 0.0,
            "pearson": _correlation(predicted, truth) if len(error) > 1 else 0.0,
            "spearman": _correlation(_ranks(predicted), _ranks(truth)) if len(error) > 1 else 0.0}


class Regression(Task):
    name = "regression"
    hf_problem_type = "regression"
    main_metrics = (("mse", "MSE"), ("pearson", "Pearson"), ("spearman", "Spearman"))
    predicts_a_number = True

    @classmethod
    def encode(cls, values: list, stored_as: str, names: tuple[str, ...]) -> list:
        """Floats."""
        return [float(v) for v in values]

    def sample_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (logits.float().squeeze(-1) - labels.float()).square()

    def dummy_labels(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(rows, device=device)

    def tally(self, device: torch.device) -> Tally:
        return Pairs()

    def report(self, details: dict[str, Any]) -> dict[str, Any]:
        predicted, truth = details["pairs"]
        return {"truth": {"mean": float(truth.mean()), "std": float(truth.std()), "min": float(truth.min()),
                          "max": float(truth.max())},
                "predicted": {"mean": float(predicted.mean()), "std": float(predicted.std()),
                              "min": float(predicted.min()), "max": float(predicted.max())}}

    def format_report(self, report: dict[str, Any]) -> list[str]:
        return [f"{side:<10} " + ", ".join(f"{k} {v:.4f}" for k, v in report[side].items())
                for side in ("truth", "predicted")]

    def plot(self, details: dict[str, Any], title: str, path: Path) -> None:
        predicted, truth = details["pairs"]
        fig, ax = figure(5, 5)
        ax.scatter(truth, predicted, s=6, alpha=0.5)
        low, high = float(min(truth.min(), predicted.min())), float(max(truth.max(), predicted.max()))
        ax.plot([low, high], [low, high], color="grey", linewidth=1, label="predicted = true")
        ax.set(xlabel="true", ylabel="predicted", title=title)
        ax.legend(fontsize=8)
        save(fig, path)

    def predictions(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        return [{"value": value} for value in logits.squeeze(-1).tolist()]

    def csv_header(self) -> list[str]:
        return ["value"]

    def csv_row(self, prediction: dict[str, Any]) -> list:
        return [repr(prediction["value"])]

    def truth(self, labels: torch.Tensor) -> list:
        return [repr(value) for value in labels.double().tolist()]
