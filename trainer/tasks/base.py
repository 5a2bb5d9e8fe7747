"""A task (data.problem_type): the loss the model trains on, the validation metrics, what
`evaluate` reports and draws and what `score` writes. Chosen once from the run's label space
(trainer/tasks/space.py) by trainer/tasks/registry.py, then asked by the step, evaluation, the
evaluate and score commands and the forecast. It says what its labels are: one number,
one class or a set of classes per row, their encoding and their balanced weights; reading
them from the data in Arrow, as it says, is trainer/data/labels.py's.

Exact evaluation: each rank tallies its shard of the split (every sample once,
samplers.EvalShardSampler), the tallies are summed (or gathered) across ranks, and the metrics are
rank 0's, the same bits on every rank: model selection and early stopping decide on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from trainer import files
from trainer.config.schema import DataConfig, TrainConfig
from trainer.runtime.environment import DistEnv
from trainer.tasks.space import Labels


class Tally:
    """One evaluation's counts on this rank, summed or gathered across ranks by `finish`."""

    def add(self, logits: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> None:
        """A batch: its logits (fp32), the model's labels, and the rows of the split they are."""
        raise NotImplementedError

    def finish(self, dist_env: DistEnv) -> tuple[dict[str, float], dict[str, Any]]:
        """Collective: (the metrics, the details `evaluate` reports and draws), from every
        rank's tallies, computed on rank 0 and the same on every rank."""
        raise NotImplementedError


class Task:
    name: ClassVar[str]
    hf_problem_type: ClassVar[str]
    """transformers' config.problem_type: how a pipeline on final/ turns logits into scores."""
    main_metrics: ClassVar[tuple[tuple[str, str], ...]]
    """(metric, how the done line names it), the ones a run ends by reporting."""

    # --- its labels, as trainer/data/labels.py reads them from the data --------------------

    predicts_a_number: ClassVar[bool] = False
    """A row's label is one number, and there are no classes."""
    label_sets: ClassVar[bool] = False
    """A row's label is a set of classes: a list of names or ids, or a multi-hot row."""
    pairs: ClassVar[bool] = False
    """A row is a preference pair (trainer/data/pairs.py), with no label column: a sample is
    two texts, which run through the model in one forward."""
    keeps_dropout: ClassVar[bool] = True
    """The model trains with its own dropout unless model.dropout says otherwise."""

    @classmethod
    def texts_per_sample(cls) -> int:
        """The texts one sample runs through the model (rows of its batch): a pair's two."""
        return 2 if cls.pairs else 1

    @classmethod
    def one_class_per_row(cls) -> bool:
        """Each row holds exactly one class: what a split can be stratified by."""
        return not (cls.predicts_a_number or cls.label_sets or cls.pairs)

    @classmethod
    def encode(cls, values: list, stored_as: str, names: tuple[str, ...]) -> list:
        """A batch of the label column's values as the model's labels. Run in the tokenizing
        map on labels trainer/data/labels.py has checked; plain arguments, which `datasets`
        hashes into the cache's name."""
        raise NotImplementedError

    @classmethod
    def balanced_weights(cls, labels: Labels) -> tuple[float, ...]:
        """train.class_weights=balanced: each class's weight from the train split's counts,
        none of them 0."""
        raise NotImplementedError

    def __init__(self, labels: Labels, data_cfg: DataConfig, train_cfg: TrainConfig | None = None):
        self.labels = labels
        self.threshold = float(data_cfg.threshold)
        self.weights = None if labels.weights is None else torch.tensor(labels.weights, dtype=torch.float32)
        self.label_smoothing = float(train_cfg.label_smoothing) if train_cfg is not None else 0.0

    # --- training ----------------------------------------------------------------------

    def per_sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits for a batch as one row per sample, what the loss, the tally and
        the predictions take: the rows themselves, but for a pair's two texts (pairwise)."""
        return logits

    def sample_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's loss, in fp32 and weighted by its class (train.class_weights). The
        step's loss is their mean over the batch, a sum over the same samples whatever the
        ranks, so 2 ranks equal 1 process; evaluation sums them."""
        raise NotImplementedError

    def unlearnt(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters the loss gives no gradient but rounding, which the step leaves out
        of each optimizer step (pairwise: the reward head's bias)."""
        return []

    def dummy_labels(self, rows: int, device: torch.device) -> torch.Tensor:
        """Labels of the model's shape and dtype for `rows` rows: the forecast times a step on them."""
        raise NotImplementedError

    # --- evaluation ----------------------------------------------------------------------

    def tally(self, device: torch.device) -> Tally:
        raise NotImplementedError

    def scores(self, metrics: dict) -> str:
        """The done line's words for a split's metrics."""
        return ", ".join(f"{words} {metrics[name]:.4f}" for name, words in self.main_metrics)

    def report(self, details: dict[str, Any]) -> dict[str, Any]:
        """What `evaluate` writes beside the metrics (JSON), from finish's details."""
        return {}

    def format_report(self, report: dict[str, Any]) -> list[str]:
        """The report's table, as `evaluate` prints it under the metrics."""
        return []

    def plot(self, details: dict[str, Any], title: str, path: Path) -> None:
        """The picture `evaluate` draws of the split (a PNG)."""
        raise NotImplementedError

    # --- score ---------------------------------------------------------------------------

    def predictions(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        """Each row's answer, by field, from its logits (fp32)."""
        raise NotImplementedError

    def csv_row(self, prediction: dict[str, Any]) -> list:
        """A prediction as csv cells, in csv_header's order (after `row`)."""
        raise NotImplementedError

    def csv_header(self) -> list[str]:
        raise NotImplementedError

    def truth(self, labels: torch.Tensor) -> list:
        """Each row's true label as a csv cell, in csv_row's terms (evaluate's rows file)."""
        raise NotImplementedError


NAMED_IN_PLOTS = 40
"""The classes a task's picture names, one by one (and a confusion matrix counts in each
cell); with more, the picture keeps this size and shows class ids: growing with the classes,
a confusion matrix of 300 took 122 s and 8 GB to draw, and one of 1,000 ran out of memory."""


def figure(width: float, height: float):
    """A matplotlib figure for a file: no display on a cluster node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save(fig, path: Path) -> None:
    """`path` holds the figure whole, or what it held before (files.write_figure)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        files.write_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
