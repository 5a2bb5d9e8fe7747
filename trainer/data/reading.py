"""The splits: `datasets` loading, each split's columns and rows checked, a validation split
held out (or a fold) where the data has none, subsampled; before any model loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config.schema import Config, DataConfig, TrainConfig
from trainer.data import arrow, datasets_errors, pairs, sources
from trainer.data import folds as folds_module
from trainer.data import labels as labels_module
from trainer.data.batch_plan import BatchPlan
from trainer.errors import ConfigError, DataError, TrainerError, describe, one_line
from trainer.runtime.distributed import local_rank_zero_first
from trainer.runtime.environment import DistEnv
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels

log = logging.getLogger(__name__)


def _load(data_cfg: DataConfig, split: str | None):
    """data.path's split `split` (a name, or `datasets` slicing: `train[:90%]`), or with
    None every split, as a DatasetDict. Local files are read by their suffix
    (trainer/data/sources.py)."""
    import datasets  # heavy import; only the training path needs it

    path = Path(data_cfg.path).expanduser()
    used_delimiter = None
    try:
        if path.is_file():
            builder = sources.BUILDERS.get(path.suffix)
            if builder is None:
                raise ConfigError(f"data.path: {path}: expected one of {sorted(sources.BUILDERS)}")
            options = sources.csv_options(data_cfg, path, path.suffix) if builder == "csv" else {}
            used_delimiter = options.get("sep")
            return datasets.load_dataset(builder, data_files=str(path), split=split, **options)
        if path.is_dir():
            suffix = sources.folder_suffix(path)
            if suffix is not None or data_cfg.csv_delimiter is not None:  # not `datasets`' own reading of them
                return datasets.load_dataset("csv", data_dir=str(path), split=split,
                                             **sources.csv_options(data_cfg, path, suffix or ".csv"))
            return datasets.load_dataset(str(path), split=split)
        return datasets.load_dataset(data_cfg.path, data_cfg.name, split=split)
    except TrainerError:
        raise
    except Exception as e:  # datasets raises many types for an unreadable or unknown source  # noqa: BLE001
        # A broken JSON line is named by its line, whichever type reports it: pyarrow's
        # ValueError for a line cut after a key, datasets' own for one cut inside a string.
        broken = sources.broken_json_line(path)
        if broken is not None:
            raise DataError(f"data.path: {data_cfg.path}: {broken}") from None
        if isinstance(e, ValueError):
            if split is not None and "split" in str(e).lower():  # a slice `datasets` can't take
                raise ConfigError(f"data split {split!r}: {one_line(e)}") from None
            raise DataError(f"data.path: {data_cfg.path}: {one_line(e)}") from None
        raise DataError(f"data.path: {data_cfg.path}: {_describe(e)}{sources.delimiter_hint(path, used_delimiter)}"
                        ) from None


def split_name(spec: str) -> str:
    """The split a spec reads: `train` of `train[:90%]`."""
    return spec.split("[", 1)[0].strip()


def _load_split(data_cfg: DataConfig, split_key: str, available: list[str]):
    """data.<split_key>'s split, which must exist and hold rows."""
    spec = getattr(data_cfg, split_key)
    if split_name(spec) not in available:
        raise ConfigError(f"data.{split_key}: {spec!r} is not a split of {data_cfg.path} (its splits: "
                          f"{', '.join(available)})")
    ds = _load(data_cfg, spec)
    if len(ds) == 0:
        raise DataError(f"data.{split_key}: {spec!r} is empty")
    return ds


def _describe(e: BaseException) -> str:
    """What is wrong with the file, by the root cause."""
    e = datasets_errors.root_cause(e)
    return describe(e) if one_line(e) else f"{describe(e)}: no rows could be read (is the file empty?)"


def _check_columns(ds, data_cfg: DataConfig, split_key: str) -> None:
    """The named columns exist, and the text columns hold text (a row without any is
    sources.invalid_rows')."""
    import pyarrow as pa

    for key in ("text_field", "text_pair_field", "label_field"):
        column = getattr(data_cfg, key)
        if column is not None and column not in ds.column_names:
            path = Path(data_cfg.path).expanduser()
            hint = (sources.delimiter_hint(path, sources.delimiter(data_cfg, path.suffix))
                    if len(ds.column_names) == 1 else "")
            raise DataError(
                f"data.{key}: column {column!r} not in {split_key} (columns: {', '.join(ds.column_names)}){hint}"
            )
    for key in ("text_field", "text_pair_field"):
        column = getattr(data_cfg, key)
        if column is not None:
            values = arrow.column(ds, column)
            if any(test(values.type) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_null)):
                continue  # a string column's nulls, and an all-null column's, are rows without text
            # any other type: the first row that is not a str, found row by row
            row = next((i for i, value in enumerate(ds[column]) if not isinstance(value, str) and value is not None),
                       None)
            if row is not None:
                raise DataError(f"data.{key}: column {column!r} in {split_key} has a non-text value "
                                  f"in row {row}: {ds[row][column]!r}")


def _subsample(ds, limit: int | None, seed: int, split_key: str):
    """Seeded, before tokenization: no wasted work."""
    if limit is None or limit >= len(ds):
        return ds
    with datasets_errors.as_data_error(f"data.{split_key}", "subsampling"):
        return ds.shuffle(seed=seed).select(range(limit))


def _hold_out(train, labels: Labels, data_cfg: DataConfig, seed: int) -> tuple[Any, Any, str]:
    """(train, validation, how): data.eval_fraction of the train split held out, seeded and,
    for single_label, stratified by class: the same rows on every rank and every restart."""
    import datasets

    fraction, parts, how = data_cfg.eval_fraction, None, "seeded"
    with datasets_errors.as_data_error("data.train_split", "holding out data.eval_fraction"):
        ids = labels_module.single_label_ids(train, labels, data_cfg)
        if ids is not None:
            by_class = train.add_column("__class__", ids).cast_column(
                "__class__", datasets.ClassLabel(num_classes=labels.num_labels))
            try:
                parts = by_class.train_test_split(test_size=fraction, seed=seed, stratify_by_column="__class__")
                parts = {name: part.remove_columns("__class__") for name, part in parts.items()}
                how = "stratified by label"
            except ValueError as e:  # a class of one row, or more classes than held-out rows
                how = f"not stratified: {one_line(e)}"
        if parts is None:
            parts = train.train_test_split(test_size=fraction, seed=seed)
    return parts["train"], parts["test"], f"{fraction * 100:g}% of data.train_split, {how}, seed {seed}"


def _fold_out(train, labels: Labels, data_cfg: DataConfig) -> tuple[Any, Any, str]:
    """(train, validation, how): fold data.fold of the train split's data.folds held out."""
    assert data_cfg.folds is not None, "a fold is held out of data.folds"
    with datasets_errors.as_data_error("data.train_split", "holding out data.fold"):
        ids = labels_module.single_label_ids(train, labels, data_cfg)
        training, validating = folds_module.held_out(folds_module.assign(len(train), data_cfg.folds, ids),
                                                     data_cfg.fold)
        how = "stratified by label" if ids is not None else "seeded"
        return (train.select(training), train.select(validating),
                f"fold {data_cfg.fold} of {data_cfg.folds} of data.train_split, {how}")


def train_folds(cfg: Config) -> tuple[np.ndarray, np.ndarray | None]:
    """(each train row's fold, its class id or None but for single_label): the folds that
    data.folds holds out, for a sweep that checks them before its trials and gathers their
    out-of-fold predictions after. In this process, no ranks."""
    data_cfg = cfg.data
    train = _readable_split(data_cfg, "train_split", list(_load(data_cfg, None).keys()), {})
    assert data_cfg.folds is not None, "folds are asked of a config with data.folds"
    ids = labels_module.single_label_ids(train, labels_module.resolve(train, data_cfg), data_cfg)
    return folds_module.assign(len(train), data_cfg.folds, ids), ids


@dataclass
class Splits:
    """The splits as loaded and checked, not yet tokenized."""

    train: Any  # datasets.Dataset: datasets ships no types
    eval: Any
    test: Any | None
    labels: Labels
    """The run's label space (trainer/data/labels.py): its classes from the whole train split, its
    counts and class weights from the rows that train."""
    held_out: str | None = None
    """How the validation split was held out of the train split (data.eval_fraction), or None:
    data.eval_split is a split of the data."""
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    """The rows data.drop_invalid_rows dropped: split: kind of problem: rows."""
    warnings: list[str] = field(default_factory=list)
    """What looks wrong in the labels (labels.name_warnings): `check` prints them, training logs them."""

    def steps_per_epoch(self, plan: BatchPlan, train_cfg: TrainConfig) -> int:
        """Optimizer steps per epoch (a last partial global batch is dropped), known before
        tokenization: the run's length, and its LR schedule's, follow from it."""
        if len(self.train) < plan.global_batch:
            key = "train.global_batch" if train_cfg.global_batch else "train.batch_size"
            raise ConfigError(f"{key}: the global batch ({plan.global_batch}) is larger than the "
                              f"{len(self.train)} training samples")
        return len(self.train) // plan.global_batch


def load(cfg: Config, dist_env: DistEnv, labels: Labels | None = None, tokenizer=None) -> Splits:
    """Every split loaded, checked and subsampled, before the model is: a mistake in the data
    is reported in seconds, not after a model download. The label space is resolved from the
    train split, or given (`labels`: a trained model's, which every split must fit). A
    preference pair's task finds the pairs that truncation makes the same with model.name's
    `tokenizer` (trainer/data/encoding.py's identical_pairs; without one, it does not look). Where
    data.eval_split names no split of the data, validation is held out of the train split.
    Local rank 0 fills the node's `datasets` cache first, the other ranks then read it."""
    data_cfg = cfg.data
    import datasets  # noqa: F401  (~0.5 s) before the wait below, not after it

    with local_rank_zero_first(dist_env, f"data.path: {data_cfg.path}"):
        available = list(_load(data_cfg, None).keys())
        dropped: dict[str, dict[str, int]] = {}
        train = _readable_split(data_cfg, "train_split", available, dropped, tokenizer)
        with datasets_errors.as_data_error("data.train_split", "reading its labels"):
            labels = labels or labels_module.resolve(train, data_cfg)
        held_out = None
        if data_cfg.folds is not None:
            train, evaluated, held_out = _fold_out(train, labels, data_cfg)
        elif split_name(data_cfg.eval_split) in available:
            evaluated = _readable_split(data_cfg, "eval_split", available, dropped, tokenizer)
        elif data_cfg.eval_split != DataConfig.eval_split and len(available) > 1:  # a mistyped split
            raise ConfigError(f"data.eval_split: {data_cfg.eval_split!r} is not a split of {data_cfg.path} (its "
                              f"splits: {', '.join(available)}); name one of them, or leave data.eval_split unset "
                              "to hold out data.eval_fraction of the train split")
        else:
            train, evaluated, held_out = _hold_out(train, labels, data_cfg, cfg.seed)
            others = [name for name in available if name != split_name(data_cfg.train_split)]
            # A warning where the data has a split that may be meant for validation.
            log.log(logging.WARNING if others else logging.INFO,
                    "data.eval_split: %r is not a split of %s (its splits: %s): validation is %s: %d rows, and %d "
                    "train rows%s", data_cfg.eval_split, data_cfg.path, ", ".join(available), held_out, len(evaluated),
                    len(train), f"; data.eval_split={others[0]} would validate on that split" if others else "")
        test = None if data_cfg.test_split is None else _readable_split(data_cfg, "test_split", available, dropped,
                                                                        tokenizer)
    train = _subsample(train, data_cfg.max_train_samples, cfg.seed, "train_split")
    evaluated = _subsample(evaluated, data_cfg.max_eval_samples, cfg.seed, "eval_split")
    test = None if test is None else _subsample(test, data_cfg.max_eval_samples, cfg.seed, "test_split")
    for split, split_key in ((evaluated, "eval_split"), (test, "test_split")):
        if split is not None:
            with datasets_errors.as_data_error(f"data.{split_key}", "reading its labels"):
                labels_module.check_split(split, labels, data_cfg, f"data.{split_key}")
    with datasets_errors.as_data_error("data.train_split", "counting its labels"):
        counted = labels_module.with_counts_and_weights(labels, train, data_cfg, cfg.train)
    return Splits(train, evaluated, test, counted, held_out, dropped, labels_module.name_warnings(counted))


def _readable_split(data_cfg: DataConfig, split_key: str, available: list[str], dropped: dict, tokenizer=None):
    """data.<split_key>'s split, its columns checked, its label names normalized and mapped
    (data.normalize_labels, data.label_map), and its rows that cannot train refused or, with
    data.drop_invalid_rows, dropped and counted into `dropped` (split: kind: rows)."""
    ds = _load_split(data_cfg, split_key, available)
    with datasets_errors.as_data_error(f"data.{split_key}", "reading its rows"):
        if task_class(data_cfg.problem_type).pairs:
            pairs.check_columns(ds, data_cfg, f"data.{split_key}")
        else:
            _check_columns(ds, data_cfg, f"data.{split_key}")
        ds, counts = sources.drop_or_refuse(labels_module.relabel(ds, data_cfg), data_cfg, f"data.{split_key}",
                                            tokenizer)
    if counts:
        dropped[split_name(getattr(data_cfg, split_key))] = counts
    return ds
