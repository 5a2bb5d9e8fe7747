"""K-fold cross-validation's folds: each row of a split assigned to one fold, seeded and, given
the rows' classes, stratified.

The assignment depends on the rows' count, their classes and the seed alone, so it is the
same on every rank, every restart and for every seed of a sweep's trials (data.folds,
data.fold). numpy alone: the data layer and the sweep both call it.
"""

from __future__ import annotations

import numpy as np

FOLD_SEED = 0
"""The seed of the folds: fixed, apart from the run's `seed`, so that every seed of a setting,
and every setting, is scored on the same folds."""


def assign(rows: int, folds: int, classes: np.ndarray | None = None, seed: int = FOLD_SEED) -> np.ndarray:
    """Each row's fold, 0 to folds - 1. With `classes` (a class id per row), each class's rows
    are shuffled and dealt to the folds in turn, the deal carried on from one class to the
    next: every fold holds each class's rows to within one, and the folds' sizes differ by at
    most one. Without, the rows are shuffled and dealt."""
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    rng = np.random.default_rng(seed)
    fold_of = np.empty(rows, dtype=np.int64)
    groups = [np.arange(rows)] if classes is None else [np.flatnonzero(classes == c) for c in np.unique(classes)]
    dealt = 0
    for members in groups:
        shuffled = rng.permutation(members)
        fold_of[shuffled] = (dealt + np.arange(len(shuffled))) % folds
        dealt += len(shuffled)
    return fold_of


def held_out(fold_of: np.ndarray, fold: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rows that train, the rows of `fold`): ascending row numbers of the split."""
    return np.flatnonzero(fold_of != fold), np.flatnonzero(fold_of == fold)
