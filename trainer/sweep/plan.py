"""What a sweep will do, checked before any trial starts: the search space and every value
in it against the schema, the number of settings, the metric and its direction, and the
folds against the train split's rarest class. Each problem is one ConfigError line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from trainer.config import loading, schema
from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainer.sweep import search_space
from trainer.tasks.registry import METRICS


@dataclass
class Plan:
    """What the sweep will do, every part of it checked."""

    space: search_space.Space
    settings: int
    metric: str
    direction: str
    fold_of: np.ndarray | None
    """Each train row's fold (sweep.folds), else None."""


def check(cfg: Config, load: Callable[[list[str]], Config]) -> Plan:
    """The sweep checked before any trial starts; each problem a one-line ConfigError."""
    sweep = cfg.sweep
    searched = search_space.parse(loading.to_dict(cfg)["sweep"]["parameters"], schema.KEYS)
    search_space.check_values(searched, load)
    settings = search_space.check_size(searched, sweep.method, sweep.trials)
    metrics = METRICS[cfg.data.problem_type]
    metric = sweep.metric or cfg.checkpoint.best_metric or next(iter(metrics))
    if metric not in metrics:
        raise ConfigError(f"sweep.metric: {metric} is not a metric of data.problem_type={cfg.data.problem_type} "
                          f"({', '.join(metrics)})")
    fold_of = None
    if sweep.ranks is not None and sweep.ranks < sweep.parallel:
        raise ConfigError(f"sweep.ranks: {sweep.parallel} trials at once (sweep.parallel) need a rank each, and "
                          f"sweep.ranks is {sweep.ranks}")
    eval_every = cfg.train.eval_every
    if sweep.pruner == "halving" and not (type(eval_every) is int and eval_every > 0):
        raise ConfigError(f"sweep.pruner: halving judges each setting by its runs' evaluations during training, at "
                          f"steps it knows before they start; train.eval_every is {eval_every}: set it to a step "
                          "count")
    if sweep.folds is not None and cfg.data.max_eval_samples is not None:
        raise ConfigError(f"sweep.folds: out-of-fold predictions need every row of each fold, and "
                          f"data.max_eval_samples={cfg.data.max_eval_samples} keeps some; set it to null")
    if sweep.folds is not None:
        fold_of = _check_folds(load([search_space.override("data.folds", sweep.folds)]), sweep.folds)
    return Plan(searched, settings, metric, metrics[metric], fold_of)


def _check_folds(cfg: Config, folds: int) -> np.ndarray:
    from trainer.data import reading

    fold_of, classes = reading.train_folds(cfg)
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


SWEEP_KEYS_FIXED = ("sweep.parameters", "sweep.method", "sweep.seeds", "sweep.folds", "sweep.metric", "sweep.pruner")
"""What a restarted sweep may not change: its runs' folders would then hold other runs. How
many settings (sweep.trials), how many at once and on how many ranks, and the refit may change."""


def check_same_sweep(previous: Path, cfg: Config) -> None:
    """A sweep started again in an output_dir whose sweep.yaml (`previous`, as the first start
    wrote it) differs in what its runs are, is refused: a finished run's folder would be read
    as a run of the new config. Keys a run may change on resume (FREE) and the sweep's own
    FREE ones may differ."""
    if not previous.is_file():
        return
    old, new = _flat(yaml.safe_load(previous.read_text())), _flat(loading.written_dict(cfg))
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key) and _decides_runs(key))
    if changed:
        raise ConfigError(f"output_dir {previous.parent}: holds a sweep of another config ({', '.join(changed[:4])}"
                          f"{' ...' if len(changed) > 4 else ''} changed); start it again with the same config, or "
                          "give a new output_dir")


def _decides_runs(key: str) -> bool:
    if key.startswith("sweep."):
        return key.startswith(SWEEP_KEYS_FIXED)
    return key != "output_dir" and schema.RESUME_RULES.get(key, schema.FIXED) != schema.FREE


def _flat(nested: Any) -> dict[str, Any]:
    return loading.flatten(nested) if isinstance(nested, dict) else {}

