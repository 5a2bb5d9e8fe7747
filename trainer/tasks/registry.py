"""data.problem_type's names, the class each one stands for, and the validation metrics it
reports with the direction each one improves in (what checkpoint.best_metric may name, and
its best_mode by default). A new task is a module in trainer/tasks/ and a line here (and, for
labels stored in a new shape, their reading in trainer/labels.py).

Torch-free, so that the config can check the names before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from trainer.labels import Labels
    from trainer.tasks.base import Task

TASKS: dict[str, tuple[str, dict[str, str]]] = {
    "single_label": ("trainer.tasks.single_label:SingleLabel", {"accuracy": "max", "f1_macro": "max", "loss": "min"}),
    "multi_label": ("trainer.tasks.multi_label:MultiLabel",
                    {"f1_micro": "max", "f1_macro": "max", "subset_accuracy": "max", "loss": "min"}),
    "regression": ("trainer.tasks.regression:Regression",
                   {"mse": "min", "mae": "min", "pearson": "max", "spearman": "max", "loss": "min"}),
}

METRICS = {name: metrics for name, (_, metrics) in TASKS.items()}
"""Each task's validation metrics: "max" where higher is better, "min" where lower is."""


def task_class(problem_type: str) -> type[Task]:
    module, _, name = TASKS[problem_type][0].partition(":")
    return getattr(importlib.import_module(module), name)


def of_transformers(hf_problem_type: str | None) -> str:
    """The task of a transformers config's problem_type (single_label where it has none)."""
    by_hf = {task_class(name).hf_problem_type: name for name in TASKS}
    return by_hf.get(hf_problem_type or "", "single_label")


def of(labels: Labels, data_cfg: DictConfig, train_cfg: DictConfig | None = None) -> Task:
    """The task of a run's label space (trainer/labels.py), with its loss settings."""
    return task_class(labels.problem_type)(labels, data_cfg, train_cfg)
