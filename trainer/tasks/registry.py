"""data.problem_type's names, the class each one stands for, and the validation metrics it
reports with the direction each one improves in (what checkpoint.best_metric may name, and
its best_mode by default). A new task is a module in trainer/tasks/ and a line here (and, for
labels stored in a new shape, their reading in trainer/data/labels.py).

Torch-free, so that a command checks what the task asks of the config (`check`, called by
trainer/cli/run_config.py) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

from trainer.config.schema import Config, DataConfig, TrainConfig
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.tasks.base import Task
    from trainer.tasks.space import Labels

Direction = Literal["max", "min"]
"""Where a metric improves: "max" where higher is better, "min" where lower is."""

TASKS: dict[str, tuple[str, dict[str, Direction]]] = {
    "single_label": ("trainer.tasks.single_label:SingleLabel", {"accuracy": "max", "f1_macro": "max", "loss": "min"}),
    "multi_label": ("trainer.tasks.multi_label:MultiLabel",
                    {"f1_micro": "max", "f1_macro": "max", "subset_accuracy": "max", "loss": "min"}),
    "regression": ("trainer.tasks.regression:Regression",
                   {"mse": "min", "mae": "min", "pearson": "max", "spearman": "max", "loss": "min"}),
    "pairwise": ("trainer.tasks.pairwise:Pairwise", {"accuracy": "max", "margin": "max", "loss": "min"}),
}

METRICS = {name: metrics for name, (_, metrics) in TASKS.items()}
"""Each task's validation metrics: "max" where higher is better, "min" where lower is."""

PAIR_TASKS = frozenset({"pairwise"})
"""The tasks whose rows are preference pairs, two texts a sample (their class's `pairs`), told
apart here without importing them (torch): for the checks before torch."""


def task_class(problem_type: str) -> type[Task]:
    module, _, name = TASKS[problem_type][0].partition(":")
    return getattr(importlib.import_module(module), name)


def of_transformers(hf_problem_type: str | None) -> str:
    """The task of a transformers config's problem_type (single_label where it has none)."""
    by_hf: dict[str, str] = {}
    for name in TASKS:  # the first task of each: one number is regression (a reward model says so itself)
        by_hf.setdefault(task_class(name).hf_problem_type, name)
    return by_hf.get(hf_problem_type or "", "single_label")


def of(labels: Labels, data_cfg: DataConfig, train_cfg: TrainConfig | None = None) -> Task:
    """The task of a run's label space (trainer/tasks/space.py), with its loss settings."""
    return task_class(labels.problem_type)(labels, data_cfg, train_cfg)


def check(cfg: Config) -> None:
    """What data.problem_type's task asks of the other keys: a ConfigError naming the first key
    it refuses. Fills checkpoint.best_mode with best_metric's own direction where it is unset."""
    data_cfg, train, ckpt = cfg.data, cfg.train, cfg.checkpoint
    problem_type = data_cfg.problem_type
    metrics = METRICS[problem_type]
    if ckpt.best_metric is None:
        for key, asked in (("checkpoint.load_best_at_end", ckpt.load_best_at_end),
                           ("train.early_stopping_patience", train.early_stopping_patience)):
            if asked:
                raise ConfigError(f"{key}: needs checkpoint.best_metric ({', '.join(metrics)})")
    elif ckpt.best_metric not in metrics:
        raise ConfigError(f"checkpoint.best_metric: {ckpt.best_metric} is not a metric of data.problem_type="
                          f"{problem_type} ({', '.join(metrics)})")
    elif ckpt.best_mode is None:
        ckpt.best_mode = metrics[ckpt.best_metric]
    num_labels = data_cfg.num_labels
    # The keys of a label space of classes, and what a task without classes leaves them at.
    no_classes = {"data.num_labels": (num_labels, (None, 1)), "data.label_names": (data_cfg.label_names, (None,)),
                  "train.class_weights": (train.class_weights, (None,))}
    if problem_type == "pairwise":
        _left_unset({**no_classes, "data.label_map": (data_cfg.label_map, (None,)),
                     "data.normalize_labels": (data_cfg.normalize_labels, (False,))},
                    "data.problem_type=pairwise learns one reward from pairs of data.chosen_field and "
                    "data.rejected_field, which have no classes and no label column")
        if data_cfg.chosen_field == data_cfg.rejected_field:
            raise ConfigError("data.rejected_field: must differ from data.chosen_field")
    elif problem_type == "regression":
        _left_unset(no_classes, "data.problem_type=regression predicts one number, which has no classes")
    elif num_labels == 1:
        raise ConfigError(f"data.num_labels: {problem_type} needs 2 or more classes; one number is "
                          "data.problem_type=regression")
    if train.center_rewards and problem_type != "pairwise":
        raise ConfigError(f"train.center_rewards: centres a reward model's rewards; data.problem_type is "
                          f"{problem_type}")
    if train.label_smoothing and problem_type != "single_label":
        raise ConfigError(f"train.label_smoothing: smooths single_label's cross-entropy; data.problem_type is "
                          f"{problem_type}")


def _left_unset(settings: dict[str, tuple[object, tuple]], why: str) -> None:
    """Each key's value (key: (value, the values it may keep)) one the task allows, else a
    ConfigError naming the first key that is set, and `why`."""
    for key, (value, allowed) in settings.items():
        if value not in allowed:
            raise ConfigError(f"{key}: {why}; leave it unset")
