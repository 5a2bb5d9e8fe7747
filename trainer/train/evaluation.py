"""Evaluation: exact metrics, every sample counted once whatever the world size.

The training loop evaluates its validation and test splits with `evaluate`; the
`python -m trainer evaluate` command (`run`) does the same on a trained model and writes the
full report, as a table on stdout, JSON and a PNG next to the model. What is tallied, reported
and drawn is the task's (trainer/tasks/): the confusion matrix and each class's precision,
recall and F1; each label's for multi_label; the predictions against the truth for regression.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer.config.schema import Config
from trainer.data import loaders, reading
from trainer.model import packing, pretrained
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import Task
from trainer.train import build

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    metrics: dict[str, float]
    """The task's metrics and the mean loss: rank 0's, on every rank bit for bit."""
    details: dict[str, Any]
    """What the task's report and picture are made of (the summed confusion matrix, ...)."""
    rows: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    """With keep_rows, on rank 0: every row of the split once, in order, its logits (fp32) and
    its labels, gathered from every rank: what the metrics were computed from."""


@torch.no_grad()
def evaluate(logits_of: nn.Module, loader: DataLoader, num_samples: int, task: Task, device: torch.device,
             dist_env: DistEnv, sharded: bool = False, keep_rows: bool = False,
             sdpa_backend: str = "auto") -> Evaluation:
    """Exact global metrics: each rank's shard once (samplers.EvalShardSampler), tallies summed.

    `logits_of` is the bare model's (no DDP wrapper), so no rank enters a collective per
    batch: ranks may hold one eval batch more or less than others. A `sharded` model (FSDP)
    gathers each block's weights in its forward, a collective: a rank with fewer batches
    then runs forwards on a filler batch, whose logits count nowhere, until every rank has
    run as many as the rank with the most. Otherwise the others would wait for it for ever.
    `sdpa_backend`: the attention kernel (model.sdpa_backend), as in the step.
    """
    with pretrained.sdpa_kernel(sdpa_backend, backward=False):
        return _evaluate(logits_of, loader, num_samples, task, device, dist_env, sharded, keep_rows)


def _evaluate(logits_of: nn.Module, loader: DataLoader, num_samples: int, task: Task, device: torch.device,
              dist_env: DistEnv, sharded: bool, keep_rows: bool) -> Evaluation:
    was_training = logits_of.training
    logits_of.eval()
    tally = task.tally(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    rows = iter(loader.sampler)  # the split's rows, in the order the loader batches them
    # Agreed before any forward, which under FSDP is itself a collective.
    most = max(distributed.all_gather(dist_env, len(loader))) if sharded else len(loader)
    kept: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    for batch in loader:
        batch = loaders.to_device(batch, device, loader)
        labels = batch.pop("labels")
        logits = task.per_sample(logits_of(**batch).float())
        loss_sum += task.sample_losses(logits, labels).sum()
        batch_rows = [next(rows) for _ in range(len(labels))]
        tally.add(logits, labels, batch_rows)
        if keep_rows:
            kept.append((batch_rows, logits.cpu(), labels.cpu()))
    if sharded:
        filler = {"input_ids": torch.ones(1, 8, dtype=torch.long, device=device),
                  "attention_mask": torch.ones(1, 8, dtype=torch.long, device=device)}
        for _ in range(most - len(loader)):
            logits_of(**filler)
    distributed.all_reduce_sum(dist_env, loss_sum)
    metrics, details = tally.finish(dist_env)
    logits_of.train(was_training)
    results = {**metrics, "loss": (loss_sum / num_samples).item()}
    # Model selection and early stopping decide on these: every rank must hold the same bits.
    return Evaluation(distributed.broadcast_from_rank_zero(dist_env, results), details,
                      _gather_rows(kept, dist_env) if keep_rows else None)


def _gather_rows(kept: list, dist_env: DistEnv) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """Every rank's kept rows on rank 0, in the split's row order."""
    shards = distributed.gather_to_rank_zero(dist_env, kept)
    if shards is None:
        return None
    batches = [batch for shard in shards for batch in shard]
    if not batches:
        return [], torch.empty(0), torch.empty(0)
    rows = torch.tensor([row for batch in batches for row in batch[0]])
    order = torch.argsort(rows, stable=True)
    return (rows[order].tolist(), torch.cat([batch[1] for batch in batches])[order],
            torch.cat([batch[2] for batch in batches])[order])


# --- `python -m trainer evaluate` ----------------------------------------------------------


def run(cfg: Config, dist_env: DistEnv, device: torch.device, folder: Path) -> dict | None:
    """Evaluate the model in `folder` (a `resume.trained_folder`) on data.eval_split; rank 0
    prints the table and writes eval-SPLIT.json and eval-SPLIT.png into the folder. Returns
    the report on rank 0."""
    trained = build.trained(cfg, dist_env, device, folder)
    splits = reading.load(cfg, dist_env, labels=trained.task.labels,  # every label one the model knows
                          tokenizer=trained.tokenizer)
    loader, num_samples = loaders.build_eval(cfg, dist_env, splits, trained.tokenizer, device,
                                             packing.of_run(cfg.data, trained.config))
    result = evaluate(trained.logits, loader, num_samples, trained.task, device, dist_env, keep_rows=True,
                      sdpa_backend=cfg.model.sdpa_backend)
    split = cfg.data.eval_split
    if splits.held_out is not None:
        split += " (held out of the train split)"
    report: dict[str, Any] = {"model": str(folder), "split": split, "samples": num_samples,
                              "problem_type": trained.task.name, **result.metrics}

    def write() -> None:
        report.update(trained.task.report(result.details))
        stem = folder / f"eval-{re.sub(r'[^A-Za-z0-9_.-]+', '_', cfg.data.eval_split).strip('_')}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        _write_rows(stem.parent / f"{stem.name}-rows.csv", trained.task, result.rows)
        trained.task.plot(result.details, f"{folder.name}, {split}", stem.with_suffix(".png"))
        print(format_report(report, trained.task), flush=True)
        log.info("wrote %s.json, %s-rows.csv and %s.png", stem, stem, stem)

    distributed.rank_zero_does(dist_env, f"evaluate: writing into {folder}", write)
    return report if dist_env.is_rank_zero else None


def _write_rows(path: Path, task: Task, kept: tuple[list[int], torch.Tensor, torch.Tensor] | None) -> None:
    """Each row of the split, once and in order: its true label and the model's answer, in
    the task's terms (score's columns): what the report's metrics are computed from."""
    assert kept is not None, "rank 0 holds the gathered rows"
    rows, logits, labels = kept
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["row", "true", *task.csv_header()])
        for row, truth, prediction in zip(rows, task.truth(labels), task.predictions(logits), strict=True):
            writer.writerow([row, truth, *task.csv_row(prediction)])


def format_report(report: dict, task: Task) -> str:
    header = (f"{report['model']} on {report['split']} ({report['samples']} samples): {task.scores(report)}, "
              f"loss {report['loss']:.4f}")
    return "\n".join([header, "", *task.format_report(report)])
