"""data.problem_type=single_label: one class of num_labels per row.

Cross-entropy, with train.label_smoothing and train.class_weights; accuracy and macro F1 from
the summed confusion matrix; `evaluate` reports each class's precision, recall, F1 and support
and draws the confusion matrix; `score` writes the class, its name and the softmax.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import NAMED_IN_PLOTS, Tally, Task, figure, save
from trainer.tasks.space import NAMES, Labels


class Confusion(Tally):
    def __init__(self, task: SingleLabel, device: torch.device):
        self.task = task
        self.counts = torch.zeros(task.labels.num_labels, task.labels.num_labels, dtype=torch.long, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> None:
        self.counts.index_put_((labels, logits.argmax(-1)), torch.ones_like(labels), accumulate=True)

    def finish(self, dist_env: DistEnv) -> tuple[dict[str, float], dict[str, Any]]:
        confusion = distributed.all_reduce_sum(dist_env, self.counts).cpu()
        return confusion_metrics(confusion), {"confusion": confusion}


def confusion_metrics(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro F1 from a [true, predicted] count matrix.

    Macro F1 averages over the classes present in the labels or the predictions, as
    scikit-learn's f1_score(average="macro") does.
    """
    confusion = confusion.double()
    true_pos = confusion.diag()
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    f1 = 2 * true_pos / (support + predicted).clamp(min=1)
    return {
        "accuracy": (true_pos.sum() / confusion.sum().clamp(min=1)).item(),
        "f1_macro": f1[present].mean().item(),
    }


def per_class_metrics(confusion: torch.Tensor, names: list[str]) -> list[dict]:
    """Precision, recall, F1 and support of each class, as scikit-learn's
    classification_report(zero_division=0) gives them: 0 where a ratio is undefined."""
    confusion = confusion.double()
    true_pos = confusion.diag()
    support, predicted = confusion.sum(1), confusion.sum(0)
    return precision_recall_f1(true_pos, predicted, support, names)


def precision_recall_f1(true_pos: torch.Tensor, predicted: torch.Tensor, support: torch.Tensor,
                        names: list[str]) -> list[dict]:
    """Each label's precision, recall, F1 and support from its counts, 0 where undefined."""
    true_pos, predicted, support = true_pos.double(), predicted.double(), support.double()
    precision = torch.where(predicted > 0, true_pos / predicted.clamp(min=1), 0.0)
    recall = torch.where(support > 0, true_pos / support.clamp(min=1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    return [
        {"label": i, "name": name, "precision": precision[i].item(), "recall": recall[i].item(),
         "f1": f1[i].item(), "support": int(support[i])}
        for i, name in enumerate(names)
    ]


def per_label_table(rows: list[dict]) -> list[str]:
    width = max(12, *(len(row["name"]) for row in rows))
    return [f"{'':<{width}}  precision  recall      f1  support"] + [
        f"{row['name']:<{width}}  {row['precision']:9.4f}  {row['recall']:6.4f}  {row['f1']:6.4f}  {row['support']:7d}"
        for row in rows]


class SingleLabel(Task):
    name = "single_label"
    hf_problem_type = "single_label_classification"
    main_metrics = (("accuracy", "accuracy"), ("f1_macro", "macro F1"))

    @classmethod
    def encode(cls, values: list, stored_as: str, names: tuple[str, ...]) -> list:
        """Class ids."""
        if stored_as == NAMES:
            index = {name: i for i, name in enumerate(names)}
            return [index[v] for v in values]
        return [int(v) for v in values]

    @classmethod
    def balanced_weights(cls, labels: Labels) -> tuple[float, ...]:
        """Rows over (classes x the class's rows): each class weighs as much in the loss."""
        return tuple(labels.rows / (labels.num_labels * count) for count in labels.counts)

    def sample_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=self.label_smoothing)
        return losses if self.weights is None else losses * self.weights.to(losses.device)[labels]

    def dummy_labels(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(rows, dtype=torch.long, device=device)

    def tally(self, device: torch.device) -> Tally:
        return Confusion(self, device)

    def report(self, details: dict[str, Any]) -> dict[str, Any]:
        names = list(self.labels.names)
        return {"per_class": per_class_metrics(details["confusion"], names),
                "confusion_matrix": details["confusion"].tolist(), "labels": names}

    def format_report(self, report: dict[str, Any]) -> list[str]:
        names = report["labels"]
        width = max(12, *(len(name) for name in names))
        return [*per_label_table(report["per_class"]), "", "confusion matrix (rows: true, columns: predicted)",
                *(f"{name:<{width}}  " + " ".join(f"{count:6d}" for count in counts)
                  for name, counts in zip(names, report["confusion_matrix"], strict=True))]

    def plot(self, details: dict[str, Any], title: str, path: Path) -> None:
        """The confusion matrix; up to NAMED_IN_PLOTS classes each cell shows its count and
        each class its name, beyond that the matrix alone, by class id, in a figure of that size."""
        confusion, names = details["confusion"], list(self.labels.names)
        size = 1.5 + 0.6 * min(len(names), NAMED_IN_PLOTS)
        fig, ax = figure(size + 1, size)
        image = ax.imshow(confusion.numpy(), cmap="Blues")
        fig.colorbar(image, ax=ax)
        ax.set(xlabel="predicted", ylabel="true", title=title)
        if len(names) > NAMED_IN_PLOTS:
            ax.set(xlabel="predicted (class id)", ylabel="true (class id)")
        else:
            ax.set(xticks=range(len(names)), yticks=range(len(names)))
            ax.set_xticklabels(names, rotation=45, ha="right")
            ax.set_yticklabels(names)
            half = confusion.max().item() / 2
            for (true, predicted), count in zip(torch.cartesian_prod(*[torch.arange(len(names))] * 2).tolist(),
                                                confusion.flatten().tolist(), strict=True):
                ax.text(predicted, true, str(count), ha="center", va="center",
                        color="white" if count > half else "black")
        save(fig, path)

    def predictions(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        out = []
        for probs in torch.softmax(logits, dim=-1).tolist():
            label = max(range(len(probs)), key=probs.__getitem__)  # argmax, the first on ties
            out.append({"label": label, "label_name": self.labels.names[label], "probs": probs})
        return out

    def csv_header(self) -> list[str]:
        return ["label", "label_name", *(f"prob_{i}" for i in range(self.labels.num_labels))]

    def csv_row(self, prediction: dict[str, Any]) -> list:
        return [prediction["label"], prediction["label_name"], *map(repr, prediction["probs"])]

    def truth(self, labels: torch.Tensor) -> list:
        return [self.labels.names[i] for i in labels.tolist()]
