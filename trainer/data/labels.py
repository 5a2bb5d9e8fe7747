"""The labels as a dataset stores them, read as the task says its labels are (one number, one
class or a set of classes per row: trainer/tasks/), into the label space the model learns
(`Labels`, trainer/tasks/space.py): resolved once from the train split's label column and
checked on every split, in Arrow (trainer/data/arrow.py: milliseconds for 400,000 rows).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from trainer.config.schema import DataConfig, TrainConfig
from trainer.data import arrow
from trainer.errors import DataError
from trainer.tasks.base import Task
from trainer.tasks.registry import task_class
from trainer.tasks.space import IDS, MULTI_HOT, NAMES, NUMBERS, PAIRS, Labels, placeholder_names, shown


def from_config(data_cfg: DataConfig) -> Labels | None:
    """The label space the config alone gives (no data read): for `check --no-data`'s memory
    plan; None where only the data can tell."""
    if task_class(data_cfg.problem_type).pairs:
        return _pairs(data_cfg.problem_type)
    if task_class(data_cfg.problem_type).predicts_a_number:
        return _a_number(data_cfg.problem_type)
    if data_cfg.label_names is not None:
        return Labels(data_cfg.problem_type, tuple(data_cfg.label_names), "data.label_names", IDS)
    if data_cfg.num_labels is not None:
        return Labels(data_cfg.problem_type, placeholder_names(data_cfg.num_labels), "data.num_labels", IDS)
    return None


def _a_number(problem_type: str) -> Labels:
    """The label space of a task whose label is one number: no classes."""
    return Labels(problem_type, (), "the task", NUMBERS)


def _pairs(problem_type: str) -> Labels:
    """The label space of a task of preference pairs: one reward, and no label column
    (trainer/data/pairs.py reads the pairs)."""
    return Labels(problem_type, (), "the task", PAIRS)


# --- reading the label column ---------------------------------------------------------------


@dataclass
class _Read:
    """A label column as one flat Arrow array of labels, and the row of each."""

    values: Any
    """The column itself (single_label, regression); the lists' elements (multi_label); for
    multi-hot rows, the position of each 1, which is its class id."""
    rows: np.ndarray | None
    """Each value's row; None: the values are the rows."""
    kind: str
    """IDS, NAMES, MULTI_HOT or NUMBERS."""
    width: int = 0
    """MULTI_HOT: the length of every row."""


def _error(data_cfg: DataConfig, split_key: str, what: str) -> DataError:
    return DataError(f"data.label_field: column {data_cfg.label_field!r} in {split_key} {what}")


def _kind(arrow_type) -> str:
    import pyarrow as pa

    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return IDS
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return NAMES
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return NUMBERS
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return "lists"
    return str(arrow_type)


_LARGEST_ID = 2**53
"""Beyond this a float is not an id (nor exactly an integer)."""


def _as_ids(values, data_cfg: DataConfig, split_key: str, row_of: Callable[[int], str], advice: str):
    """`values` (numbers) as int64 class ids. Each must be a whole number a class id can be:
    1.0 is (as pandas writes ids beside a missing value); NaN, inf, 2.5 and 1e30 are not, and
    the first of them is named, in `row_of(its index)`, with `advice`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    as_float = values.cast(pa.float64())
    whole = pc.and_(pc.equal(pc.floor(as_float), as_float), pc.less_equal(pc.abs(as_float), _LARGEST_ID))
    bad = arrow.first_true(pc.invert(pc.fill_null(whole, False)))
    if bad is not None:
        raise _error(data_cfg, split_key, f"holds numbers that are not class ids ({values[bad].as_py()!r} in "
                                          f"{row_of(bad)}): {advice}")
    return as_float.cast(pa.int64())


def _read(column, data_cfg: DataConfig, split_key: str, multi_hot: bool | None = None) -> _Read:
    """The labels of `column`, checked for the task: no nulls, the type the task reads.
    `multi_hot`: whether multi_label lists are multi-hot rows; None: decided by the lists."""
    import pyarrow.compute as pc

    null = arrow.first_null(column)
    if null is not None:
        raise _error(data_cfg, split_key, f"has no label in row {null}")
    kind, problem, task = _kind(column.type), data_cfg.problem_type, task_class(data_cfg.problem_type)
    if task.label_sets:
        if kind != "lists":
            raise _error(data_cfg, split_key, f"holds {kind}, not lists: data.problem_type={problem} reads a list "
                                              "of class names or ids per row (JSONL or Parquet: [\"a\", \"c\"])")
        return _read_lists(column, data_cfg, split_key, multi_hot)
    if kind == "lists":
        raise _error(data_cfg, split_key, f"holds lists: for a set of classes per row, set data.problem_type="
                                          f"multi_label (data.problem_type is {problem})")
    if kind not in (IDS, NAMES, NUMBERS):  # a JSON column of mixed values, a struct, ...
        raise _error(data_cfg, split_key, f"holds values of type {kind}, not class ids, names, lists or numbers "
                                          "(are its rows of one kind?)")
    if task.predicts_a_number:
        if kind == NAMES:
            raise _error(data_cfg, split_key, f"holds names: data.problem_type={problem} needs numbers")
        nan = arrow.first_true(pc.is_nan(column.cast("float64")))
        if nan is not None:
            raise _error(data_cfg, split_key, f"has NaN in row {nan}")
        return _Read(column, None, NUMBERS)
    if kind == NUMBERS:
        ids = _as_ids(column, data_cfg, split_key, lambda i: f"row {i}", f"{problem} needs class ids (integers) "
                      "or names (strings); for a number to predict, set data.problem_type=regression")
        return _Read(ids, None, IDS)
    return _Read(column, None, kind)


def _read_lists(column, data_cfg: DataConfig, split_key: str, multi_hot: bool | None) -> _Read:
    """multi_label's lists: of class names or ids, or multi-hot rows (a 0 or 1 per label, as
    many in every row). Lists of 0s and 1s are multi-hot where a row repeats a value or every
    row holds two or more: as ids, a row would list a class twice, or every row the same two."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values, rows = pc.list_flatten(column), pc.list_parent_indices(column).to_numpy()
    null = arrow.first_null(values)
    if null is not None:
        raise _error(data_cfg, split_key, f"has a null label in the list of row {rows[null]}")
    kind = _kind(values.type)
    if kind == NUMBERS:
        values = _as_ids(values, data_cfg, split_key, lambda i: f"the list of row {rows[i]}", "multi_label reads "
                         "each row's class names or ids, or a multi-hot row (a 0 or 1 per label)")
        kind = IDS
    if kind not in (IDS, NAMES):
        raise _error(data_cfg, split_key, f"holds lists of {kind}: multi_label reads each row's class names or ids, "
                                          "or a multi-hot row (a 0 or 1 per label)")
    if kind == NAMES or multi_hot is False:
        return _Read(values, rows, kind)
    as_ints = values.cast(pa.int64()).to_numpy(zero_copy_only=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    width = int(lengths.max())
    zero_or_one = bool(((as_ints == 0) | (as_ints == 1)).all())
    if multi_hot is None:
        repeats = any(np.bincount(rows[as_ints == v], minlength=len(lengths)).max(initial=0) > 1 for v in (0, 1))
        if not zero_or_one or not (repeats or int(lengths.min()) >= 2):
            return _Read(values, rows, IDS)
    other = np.flatnonzero(lengths != width)
    if len(other):
        raise _error(data_cfg, split_key, f"holds multi-hot rows of {lengths[other[0]]} and {width} values (row "
                                          f"{other[0]}): each row holds a 0 or 1 for every label")
    if not zero_or_one:
        first = int(np.flatnonzero((as_ints != 0) & (as_ints != 1))[0])
        raise _error(data_cfg, split_key, f"holds {as_ints[first]} in the multi-hot row {rows[first]}: a multi-hot "
                                          "row holds a 0 or 1 per label")
    positions = np.flatnonzero(as_ints == 1)
    return _Read(pa.array(positions % width, type=pa.int64()), positions // width, MULTI_HOT, width)


def unlabelled_rows(column, problem_type: str) -> np.ndarray:
    """The rows of a label column that hold no label: null, a NaN number (regression), a
    null list or a null in a list (a set of classes: multi_label)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = pc.is_null(column)
    if _kind(column.type) == NUMBERS:
        missing = pc.or_(missing, pc.fill_null(pc.is_nan(column.cast(pa.float64())), False))
    rows = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
    if task_class(problem_type).label_sets and _kind(column.type) == "lists":
        values = pc.list_flatten(column)
        if values.null_count:
            parents = pc.list_parent_indices(column).to_numpy()
            rows = np.union1d(rows, parents[np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))])
    return rows


PLACEHOLDERS = ("", "n/a", "na", "none", "null", "nan", "-", "?", "unknown")
"""Label names that usually stand for no label (after stripping and case-folding). A tuple,
not a set: a set's order, so its pickle, changes with each process's string hash seed, and
`datasets` names a map's cache by pickling what its function reaches."""


def name_warnings(labels: Labels) -> list[str]:
    """What looks wrong in class names read from the data: names that differ only by case or
    surrounding spaces (each a class of its own), and names that stand for no label."""
    if labels.stored_as != NAMES or labels.source != "the train split":
        return []
    counts = dict(zip(labels.names, labels.counts, strict=True)) if labels.counts else {}
    groups: dict[str, list[str]] = {}
    for name in labels.names:
        groups.setdefault(name.strip().casefold(), []).append(name)
    warnings = [f"label names {', '.join(map(repr, same))} differ only by case or spaces, and train as "
                f"{len(same)} classes: set data.normalize_labels=true to make them one"
                for same in groups.values() if len(same) > 1]
    for name in labels.names:
        if name.strip().casefold() in PLACEHOLDERS:
            rows = f" ({counts[name]:,} train rows)" if name in counts else ""
            warnings.append(f"label name {name!r}{rows} looks like a placeholder for no label, and trains as a "
                            f"class: if it means no label, set data.label_map='{{{json.dumps(name)}: null}}' "
                            "with data.drop_invalid_rows=true, or fix the file")
    return warnings


def relabel(ds, data_cfg: DataConfig):
    """`ds` with its label names normalized (data.normalize_labels) and mapped
    (data.label_map): before the classes are found. A name mapped to null leaves the row with
    no label (a list's element: it leaves the list). Class ids and numbers are left as they are."""
    import pyarrow as pa

    mapping = None if data_cfg.label_map is None else {str(k): v for k, v in data_cfg.label_map.items()}
    normalize, field = bool(data_cfg.normalize_labels), str(data_cfg.label_field)
    if not normalize and not mapping:
        return ds
    column_type = arrow.column(ds, field).type
    lists = pa.types.is_list(column_type) or pa.types.is_large_list(column_type)
    if _kind(column_type.value_type if lists else column_type) != NAMES:
        return ds

    def name(value):
        if value is None:
            return None
        value = value.strip().casefold() if normalize else value
        return mapping.get(value, value) if mapping else value

    def rename(batch):
        values = batch[field]
        if lists:
            batch[field] = [None if row is None else [n for n in map(name, row) if n is not None] for row in values]
        else:
            batch[field] = [name(value) for value in values]
        return batch

    return ds.map(rename, batched=True, desc="data.label_map" if mapping else "data.normalize_labels")


def _class_label_names(feature) -> list[str] | None:
    """A ClassLabel's names: the column's own, or its elements' (a list of ClassLabel)."""
    for candidate in (feature, getattr(feature, "feature", None)):
        names = getattr(candidate, "names", None)
        if names:
            return list(names)
    return None


def resolve(train_ds, data_cfg: DataConfig) -> Labels:
    """The run's classes from the whole train split (a `datasets` split); its counts and
    weights are `with_counts_and_weights`'s."""
    import pyarrow.compute as pc

    if task_class(data_cfg.problem_type).pairs:
        return _pairs(data_cfg.problem_type)
    column, field = arrow.column(train_ds, data_cfg.label_field), data_cfg.label_field
    feature_names = _class_label_names(train_ds.features.get(field))
    # A list of ClassLabel holds ids, whatever their values.
    read = _read(column, data_cfg, "data.train_split", multi_hot=False if feature_names else None)
    if task_class(data_cfg.problem_type).predicts_a_number:
        return _a_number(data_cfg.problem_type)
    if data_cfg.label_names is not None:
        names, source = list(data_cfg.label_names), "data.label_names"
        _same_order(names, feature_names, field)
    elif feature_names is not None:
        names, source = feature_names, "ClassLabel"
    elif read.kind == NAMES:
        names, source = sorted(pc.unique(read.values).to_pylist()), "the train split"
    elif data_cfg.num_labels is not None:
        names, source = list(placeholder_names(data_cfg.num_labels)), "data.num_labels"
    elif read.kind == MULTI_HOT:
        names, source = list(placeholder_names(read.width)), "the train split's multi-hot rows"
    else:
        high = pc.max(read.values).as_py()
        names, source = list(placeholder_names(0 if high is None else int(high) + 1)), "the train split's ids"
    if data_cfg.num_labels is not None and len(names) != data_cfg.num_labels:
        raise DataError(f"data.num_labels: {data_cfg.num_labels}, but the labels are {len(names)} "
                        f"({shown(names)}, from {source})")
    if len(names) < 2:
        raise DataError(f"data.label_field: column {field!r} in data.train_split has {len(names)} "
                        f"class{'es' if len(names) != 1 else ''} ({shown(names)}): {data_cfg.problem_type} needs "
                        "2 or more")
    stored_as = read.kind if read.kind in (NAMES, MULTI_HOT) else IDS
    labels = Labels(data_cfg.problem_type, tuple(map(str, names)), source, stored_as)
    _ids(train_ds, labels, data_cfg, "data.train_split")  # every train label is one of them
    return labels


def _same_order(names: list[str], feature_names: list[str] | None, field: str) -> None:
    """data.label_names may rename a ClassLabel's ids, not reorder them: the column stores ids."""
    if feature_names is None:
        return
    moved = [name for name in names if name in feature_names and names.index(name) != feature_names.index(name)]
    if moved:
        raise DataError(f"data.label_names: {moved[0]!r} is id {names.index(moved[0])} there and id "
                        f"{feature_names.index(moved[0])} in column {field!r}'s ClassLabel ({shown(feature_names)}): "
                        "the column stores ids, so the names follow ClassLabel's order; leave data.label_names unset "
                        "to use them")


def _ids(ds, labels: Labels, data_cfg: DataConfig, split_key: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The class id of every label of split `ds`, and the row of each (None: one per row),
    each checked to be one of `labels`: an unknown one is an error naming the value, the
    split and the row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # Lists of ClassLabel are ids; other lists of 0s and 1s are looked at in every split, so that
    # multi-hot rows where train holds ids (or the other way round) are refused, not misread.
    class_label = _class_label_names(ds.features.get(data_cfg.label_field)) is not None
    multi_hot = True if labels.stored_as == MULTI_HOT else False if class_label else None
    read = _read(arrow.column(ds, data_cfg.label_field), data_cfg, split_key, multi_hot)

    def row_of(i: int) -> int:
        return i if read.rows is None else int(read.rows[i])

    if read.kind != labels.stored_as:
        raise _error(data_cfg, split_key, f"holds {read.kind}, where the labels from {labels.source} are "
                                          f"{labels.stored_as}")
    if read.kind == MULTI_HOT and read.width != labels.num_labels:
        raise _error(data_cfg, split_key, f"holds multi-hot rows of {read.width} values, for the {labels.num_labels} "
                                          f"labels from {labels.source} ({shown(labels.names)})")
    if read.kind == NAMES:
        ids = pc.index_in(read.values, value_set=pa.array(labels.names))
        missing = arrow.first_null(ids)
        if missing is not None:
            raise _error(data_cfg, split_key, f"has {read.values[missing].as_py()!r} in row {row_of(missing)}, which "
                                              f"is not one of the labels from {labels.source} "
                                              f"({shown(labels.names)})")
        return ids.to_numpy(zero_copy_only=False).astype(np.int64), read.rows
    ids = read.values.cast(pa.int64())
    outside = arrow.first_true(pc.or_(pc.less(ids, 0), pc.greater_equal(ids, labels.num_labels)))
    if outside is not None:
        extremes = pc.min_max(ids)
        key = labels.source if labels.source.startswith("data.") else "data.label_field"
        raise DataError(f"{key}: {split_key} has labels in [{extremes['min']}, {extremes['max']}], outside "
                        f"[0, {labels.num_labels - 1}] (row {row_of(outside)}): the labels from {labels.source} are "
                        f"{labels.num_labels}")
    return ids.to_numpy(zero_copy_only=False), read.rows


def check_split(ds, labels: Labels, data_cfg: DataConfig, split_key: str) -> None:
    """Every label of another split (validation, test) is one the run knows."""
    if _task(labels).pairs:  # no label column: its pairs were read with its rows
        return
    if _task(labels).predicts_a_number:
        _read(arrow.column(ds, data_cfg.label_field), data_cfg, split_key)
    else:
        _ids(ds, labels, data_cfg, split_key)


def single_label_ids(ds, labels: Labels, data_cfg: DataConfig) -> np.ndarray | None:
    """Each row's class id, for stratifying a split; None where a row holds no one class."""
    if not _task(labels).one_class_per_row():
        return None
    return _ids(ds, labels, data_cfg, "data.train_split")[0]


def with_counts_and_weights(labels: Labels, train_ds, data_cfg: DataConfig, train_cfg: TrainConfig) -> Labels:
    """`labels` with the count of each class in the rows that train (after a held-out
    validation share and data.max_train_samples), and the class weights."""
    if _task(labels).predicts_a_number or _task(labels).pairs:
        return replace(labels, rows=len(train_ds))
    ids, rows = _ids(train_ds, labels, data_cfg, "data.train_split")
    if rows is not None:  # the rows holding each label: a label listed twice in a row counts once
        ids = np.unique(rows * labels.num_labels + ids) % labels.num_labels
    counted = replace(labels, counts=tuple(int(n) for n in np.bincount(ids, minlength=labels.num_labels)),
                      rows=len(train_ds))
    return replace(counted, weights=_weights(counted, train_cfg.class_weights))


def _weights(labels: Labels, setting: Any) -> tuple[float, ...] | None:
    """train.class_weights for `labels`: balanced from the train split's counts, or the list."""
    if setting is None:
        return None
    if setting != "balanced":
        if len(setting) != labels.num_labels:
            raise DataError(f"train.class_weights: expected {labels.num_labels} weights, one per label "
                            f"({shown(labels.names)}), got {len(setting)}")
        return tuple(float(w) for w in setting)
    empty = [name for name, count in zip(labels.names, labels.counts, strict=True) if count == 0]
    if empty:
        raise DataError(f"train.class_weights: balanced weighs each class by its train rows, and "
                        f"{shown(empty)} {'has' if len(empty) == 1 else 'have'} none")
    return _task(labels).balanced_weights(labels)


# --- into the model's labels -----------------------------------------------------------------


def ledger_keys(column) -> np.ndarray:
    """One int64 per row that changes with the row's label (the model's, after `encode`), for
    the data ledger (trainer/data/samplers.py): the class id; a number's bits; a multi-hot row packed."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_integer(column.type):
        return np.asarray(column.to_numpy(), dtype=np.int64).copy()
    if pa.types.is_floating(column.type):
        return np.asarray(column.to_numpy(), dtype=np.float64).view(np.int64).copy()
    width = len(column[0]) if len(column) else 0
    hot = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=bool).reshape(len(column), width)
    packed = np.packbits(hot, axis=1)
    words = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 8))).view(np.uint64)
    if words.shape[1] <= 1:  # up to 64 labels: the row's bits themselves
        return words.sum(axis=1, dtype=np.uint64).view(np.int64)
    # More: the words chained through a bijective mix, so that rows differing in one word
    # always differ, and others as by chance (a sum of each word times a power of an odd
    # number gave two rows with the top bit of words 0 and 1 the same key).
    key = np.zeros(len(words), dtype=np.uint64)
    for word in words.T:
        key = _mix64(key ^ word)
    return key.view(np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 in which every output bit depends on every
    input bit (products wrap modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _task(labels: Labels) -> type[Task]:
    return task_class(labels.problem_type)
