"""Evaluation: exact metrics, every sample counted once whatever the world size.

The training loop evaluates its validation and test splits with `evaluate`; the
`python -m trainer evaluate` command (`run`) does the same on a trained model and writes the
full report: per-class precision, recall, F1 and support, and the confusion matrix, as a
table on stdout, JSON and a PNG next to the model. `confusion_metrics` and
`per_class_metrics` turn the summed confusion matrix into accuracy and F1.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader

from trainer import build, data, distributed, model
from trainer.distributed import DistEnv

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    metrics: dict[str, float]
    """accuracy, f1_macro, loss: rank 0's, on every rank bit for bit."""
    confusion: torch.Tensor
    """[true, predicted] counts over every rank's shard."""


@torch.no_grad()
def evaluate(logits_of: nn.Module, loader: DataLoader, num_samples: int, num_labels: int,
             device: torch.device, dist_env: DistEnv, sharded: bool = False) -> Evaluation:
    """Exact global metrics: each rank's shard once (data.EvalShardSampler), counts summed.

    `logits_of` is the bare model's (no DDP wrapper), so no rank enters a collective per
    batch: ranks may hold one eval batch more or less than others. A `sharded` model (FSDP)
    gathers each block's weights in its forward, a collective: a rank with fewer batches
    then runs forwards on a filler batch, whose logits count nowhere, until every rank has
    run as many as the rank with the most. Otherwise the others would wait for it for ever.
    """
    was_training = logits_of.training
    logits_of.eval()
    confusion = torch.zeros(num_labels, num_labels, dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # Agreed before any forward, which under FSDP is itself a collective.
    most = max(distributed.all_gather(dist_env, len(loader))) if sharded else len(loader)
    for batch in loader:
        batch = data.to_device(batch, device, loader)
        labels = batch.pop("labels")
        logits = logits_of(**batch).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        confusion.index_put_((labels, logits.argmax(-1)), torch.ones_like(labels), accumulate=True)
    if sharded:
        filler = {"input_ids": torch.ones(1, 8, dtype=torch.long, device=device),
                  "attention_mask": torch.ones(1, 8, dtype=torch.long, device=device)}
        for _ in range(most - len(loader)):
            logits_of(**filler)
    distributed.all_reduce_sum(dist_env, confusion)
    distributed.all_reduce_sum(dist_env, loss_sum)
    logits_of.train(was_training)
    confusion = confusion.cpu()
    results = {**confusion_metrics(confusion), "loss": (loss_sum / num_samples).item()}
    # Model selection and early stopping decide on these: every rank must hold the same bits.
    return Evaluation(distributed.broadcast_from_rank_zero(dist_env, results), confusion)


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
    precision = torch.where(predicted > 0, true_pos / predicted.clamp(min=1), 0.0)
    recall = torch.where(support > 0, true_pos / support.clamp(min=1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    return [
        {"label": i, "name": name, "precision": precision[i].item(), "recall": recall[i].item(),
         "f1": f1[i].item(), "support": int(support[i])}
        for i, name in enumerate(names)
    ]


# --- `python -m trainer evaluate` ----------------------------------------------------------


def run(cfg: DictConfig, dist_env: DistEnv, device: torch.device, folder: Path) -> dict | None:
    """Evaluate the model in `folder` (a `model.trained_folder`) on data.eval_split; rank 0
    prints the table and writes eval-SPLIT.json and eval-SPLIT.png into the folder. Returns
    the report on rank 0."""
    trained, logits_of = build.trained(cfg, dist_env, device, folder)
    loader, num_samples, names = data.build_eval(cfg, dist_env, trained.tokenizer, device)
    names = names or model.config_label_names(trained.model, cfg.data.num_labels)
    result = evaluate(logits_of, loader, num_samples, cfg.data.num_labels, device, dist_env)
    split = cfg.data.eval_split
    report = {
        "model": str(folder), "split": split, "samples": num_samples, **result.metrics,
        "per_class": per_class_metrics(result.confusion, names),
        "confusion_matrix": result.confusion.tolist(), "labels": names,
    }

    def write() -> None:
        stem = folder / f"eval-{re.sub(r'[^A-Za-z0-9_.-]+', '_', split).strip('_')}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        plot_confusion(result.confusion, names, f"{folder.name}, {split}", stem.with_suffix(".png"))
        print(format_report(report), flush=True)
        log.info("wrote %s.json and %s.png", stem, stem)

    distributed.rank_zero_does(dist_env, f"evaluate: writing into {folder}", write)
    return report if dist_env.is_rank_zero else None


def format_report(report: dict) -> str:
    width = max(12, *(len(name) for name in report["labels"]))
    lines = [(f"{report['model']} on {report['split']} ({report['samples']} samples): "
              f"accuracy {report['accuracy']:.4f}, macro F1 {report['f1_macro']:.4f}, loss {report['loss']:.4f}"),
             "",
             f"{'':<{width}}  precision  recall      f1  support"]
    lines += [f"{row['name']:<{width}}  {row['precision']:9.4f}  {row['recall']:6.4f}  "
              f"{row['f1']:6.4f}  {row['support']:7d}" for row in report["per_class"]]
    lines += ["", "confusion matrix (rows: true, columns: predicted)"]
    lines += [f"{name:<{width}}  " + " ".join(f"{count:6d}" for count in counts)
              for name, counts in zip(report["labels"], report["confusion_matrix"], strict=True)]
    return "\n".join(lines)


def plot_confusion(confusion: torch.Tensor, names: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    size = 1.5 + 0.6 * len(names)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(confusion.numpy(), cmap="Blues")
    fig.colorbar(image, ax=ax)
    ax.set(xticks=range(len(names)), yticks=range(len(names)), xlabel="predicted", ylabel="true", title=title)
    ax.set_xticklabels(names, rotation=45, ha="right")
    ax.set_yticklabels(names)
    half = confusion.max().item() / 2
    for (true, predicted), count in zip(torch.cartesian_prod(*[torch.arange(len(names))] * 2).tolist(),
                                        confusion.flatten().tolist(), strict=True):
        ax.text(predicted, true, str(count), ha="center", va="center",
                color="white" if count > half else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
