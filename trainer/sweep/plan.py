"""What a sweep will do, checked before any trial starts: the search space and every value
in it against the schema, the number of settings, the metric and its direction, and the
folds against the train split's rarest class. Each problem is one ConfigError line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig

from trainer import config
from trainer.errors import ConfigError
from trainer.sweep import space
from trainer.tasks.registry import METRICS


@dataclass
class Plan:
    """What the sweep will do, every part of it checked."""

    space: space.Space
    settings: int
    metric: str
    direction: str
    fold_of: np.ndarray | None
    """Each train row's fold (sweep.folds), else None."""


def check(cfg: DictConfig, load: Callable[[list[str]], DictConfig]) -> Plan:
    """The sweep checked before any trial starts; each problem a one-line ConfigError."""
    sweep = cfg.sweep
    searched = space.parse(config.to_dict(cfg)["sweep"]["parameters"], config.KEYS)
    space.check_values(searched, load)
    settings = space.check_size(searched, sweep.method, sweep.trials)
    metrics = METRICS[cfg.data.problem_type]
    metric = sweep.metric or cfg.checkpoint.best_metric or next(iter(metrics))
    if metric not in metrics:
        raise ConfigError(f"sweep.metric: {metric} is not a metric of data.problem_type={cfg.data.problem_type} "
                          f"({', '.join(metrics)})")
    fold_of = None
    if sweep.folds is not None and cfg.data.max_eval_samples is not None:
        raise ConfigError(f"sweep.folds: out-of-fold predictions need every row of each fold, and "
                          f"data.max_eval_samples={cfg.data.max_eval_samples} keeps some; set it to null")
    if sweep.folds is not None:
        fold_of = _check_folds(load([space.override("data.folds", sweep.folds)]), sweep.folds)
    return Plan(searched, settings, metric, metrics[metric], fold_of)


def _check_folds(cfg: DictConfig, folds: int) -> np.ndarray:
    from trainer import data

    fold_of, classes = data.train_folds(cfg)
    if classes is None:
        if len(fold_of) < folds:
            raise ConfigError(f"sweep.folds: {folds} folds need {folds} train rows or more; there are {len(fold_of)}")
        return fold_of
    counts = np.bincount(classes)
    rarest = int(np.argmin(np.where(counts > 0, counts, np.iinfo(np.int64).max)))
    if counts[rarest] < folds:
        raise ConfigError(f"sweep.folds: {folds} folds need {folds} rows of each class in the train split; class "
                          f"{rarest} has {counts[rarest]}")
    return fold_of
