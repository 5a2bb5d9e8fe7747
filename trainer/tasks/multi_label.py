"""data.problem_type=multi_label: any set of num_labels classes per row (tags, toxicity types).

Binary cross-entropy on each label's logit (train.class_weights: each label's positives
weighed against its negatives, BCE's pos_weight); a label is predicted where its sigmoid
reaches data.threshold. Metrics, from counts summed over the ranks: micro F1 (every label's
decisions pooled), macro F1 (the mean of each label's F1, over the labels present in the truth
or the predictions, as single_label's) and subset accuracy (rows whose predicted set is their
set exactly). `evaluate` draws each label's precision, recall and F1 as bars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.errors import DataError
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import NAMED_IN_PLOTS, Tally, Task, figure, save
from trainer.tasks.single_label import per_label_table, precision_recall_f1
from trainer.tasks.space import MULTI_HOT, NAMES, Labels, shown


class Decisions(Tally):
    def __init__(self, task: MultiLabel, device: torch.device):
        self.threshold = task.threshold
        # Per label: rows predicted and truly holding it, predicted, truly holding it.
        self.counts = torch.zeros(3, task.labels.num_labels, dtype=torch.long, device=device)
        self.rows = torch.zeros(2, dtype=torch.long, device=device)
        """The rows, and those whose predicted set is exactly their set."""

    def add(self, logits: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> None:
        predicted, truth = torch.sigmoid(logits) >= self.threshold, labels >= 0.5
        self.counts += torch.stack([(predicted & truth).sum(0), predicted.sum(0), truth.sum(0)])
        self.rows += torch.stack([self.rows.new_tensor(len(labels)), (predicted == truth).all(-1).sum()])

    def finish(self, dist_env: DistEnv) -> tuple[dict[str, float], dict[str, Any]]:
        true_pos, predicted, present = distributed.all_reduce_sum(dist_env, self.counts).cpu().double()
        rows, exact = distributed.all_reduce_sum(dist_env, self.rows).tolist()
        seen = (predicted + present) > 0
        f1 = 2 * true_pos / (predicted + present).clamp(min=1)
        metrics = {"f1_micro": (2 * true_pos.sum() / (predicted.sum() + present.sum()).clamp(min=1)).item(),
                   "f1_macro": f1[seen].mean().item() if bool(seen.any()) else 0.0,
                   "subset_accuracy": exact / max(rows, 1)}
        return metrics, {"true_pos": true_pos, "predicted": predicted, "present": present}


class MultiLabel(Task):
    name = "multi_label"
    hf_problem_type = "multi_label_classification"
    main_metrics = (("f1_micro", "micro F1"), ("f1_macro", "macro F1"), ("subset_accuracy", "subset accuracy"))
    label_sets = True

    @classmethod
    def encode(cls, values: list, stored_as: str, names: tuple[str, ...]) -> list:
        """Multi-hot rows of floats, from multi-hot rows or lists of names or ids."""
        if stored_as == MULTI_HOT:
            return [[float(v) for v in row] for row in values]
        index = {name: i for i, name in enumerate(names)} if stored_as == NAMES else None
        rows = []
        for row in values:
            hot = [0.0] * len(names)
            for value in row:
                hot[index[value] if index is not None else int(value)] = 1.0
            rows.append(hot)
        return rows

    @classmethod
    def balanced_weights(cls, labels: Labels) -> tuple[float, ...]:
        """Each label's negatives over its positives (BCE's pos_weight)."""
        everywhere = [name for name, count in zip(labels.names, labels.counts, strict=True) if count == labels.rows]
        if everywhere:
            raise DataError(f"train.class_weights: balanced weighs each label's positives against its negatives, "
                            f"and {shown(everywhere)} is in every train row")
        return tuple((labels.rows - count) / count for count in labels.counts)

    def sample_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos_weight = None if self.weights is None else self.weights.to(logits.device)
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), pos_weight=pos_weight,
                                                  reduction="none").mean(-1)

    def dummy_labels(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(rows, self.labels.num_labels, device=device)

    def tally(self, device: torch.device) -> Tally:
        return Decisions(self, device)

    def report(self, details: dict[str, Any]) -> dict[str, Any]:
        names = list(self.labels.names)
        return {"per_label": precision_recall_f1(details["true_pos"], details["predicted"], details["present"], names),
                "labels": names, "threshold": self.threshold}

    def format_report(self, report: dict[str, Any]) -> list[str]:
        return [f"each label, predicted where its sigmoid reaches {report['threshold']:g}",
                *per_label_table(report["per_label"])]

    def plot(self, details: dict[str, Any], title: str, path: Path) -> None:
        rows = self.report(details)["per_label"]
        fig, ax = figure(2 + 0.5 * min(len(rows), NAMED_IN_PLOTS), 4)
        width = 0.27
        for offset, metric in enumerate(("precision", "recall", "f1")):
            ax.bar([i + (offset - 1) * width for i in range(len(rows))], [row[metric] for row in rows], width,
                   label=metric)
        ax.set(ylim=(0, 1.05), ylabel="per label", title=title)
        if len(rows) <= NAMED_IN_PLOTS:
            ax.set(xticks=range(len(rows)))
            ax.set_xticklabels([row["name"] for row in rows], rotation=45, ha="right")
        else:
            ax.set(xlabel="label id")
        ax.legend(fontsize=8)
        save(fig, path)

    def predictions(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        out = []
        for probs in torch.sigmoid(logits).tolist():
            chosen = [i for i, p in enumerate(probs) if p >= self.threshold]
            out.append({"labels": chosen, "label_names": [self.labels.names[i] for i in chosen], "probs": probs})
        return out

    def csv_header(self) -> list[str]:
        return ["labels", "label_names", *(f"prob_{i}" for i in range(self.labels.num_labels))]

    def csv_row(self, prediction: dict[str, Any]) -> list:
        return ["|".join(map(str, prediction["labels"])), "|".join(prediction["label_names"]),
                *map(repr, prediction["probs"])]

    def truth(self, labels: torch.Tensor) -> list:
        return ["|".join(self.labels.names[i] for i, hot in enumerate(row) if hot) for row in labels.tolist()]
