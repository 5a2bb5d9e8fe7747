"""The labels as a dataset stores them, and the label space the model learns: resolved once
from the train split's label column and checked on every split, in Arrow (no Python loop
over the rows: milliseconds for 400,000 of them).

`Labels` is the run's label space: the task (data.problem_type), the class names in id order
and where they came from, how the column stores them (class ids, names, numbers), each class's
count in the train split, and the class weights (train.class_weights). It is saved in every
checkpoint, whose resume refuses data that gives another (trainer/checkpoint/train_state.py),
goes into final/'s config (id2label, problem_type) and summary.json, and `check` prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from trainer.errors import DataError

IDS, NAMES, NUMBERS = "ids", "names", "numbers"
"""How a label column stores its labels."""


@dataclass(frozen=True)
class Labels:
    problem_type: str
    names: tuple[str, ...]
    """The class names in id order (LABEL_0, ... for ids without names); () for regression."""
    source: str
    """Where the names come from: data.label_names, ClassLabel, the train split, ids."""
    stored_as: str
    """IDS, NAMES or NUMBERS."""
    counts: tuple[int, ...] = ()
    """The train split's rows of each class (multi_label: the rows that hold it)."""
    rows: int = 0
    """The train split's rows."""
    weights: tuple[float, ...] | None = None
    """Each class's weight in the loss (train.class_weights), None: unweighted."""

    @property
    def num_labels(self) -> int:
        """The classification head's outputs."""
        return 1 if self.problem_type == "regression" else len(self.names)

    @property
    def index(self) -> dict[str, int] | None:
        """Each name's id, for a column of names; None for ids and numbers."""
        return {name: i for i, name in enumerate(self.names)} if self.stored_as == NAMES else None

    def state_dict(self) -> dict:
        return {**asdict(self), "names": list(self.names), "counts": list(self.counts),
                "weights": None if self.weights is None else list(self.weights)}

    @classmethod
    def from_state(cls, state: dict) -> Labels:
        return cls(state["problem_type"], tuple(state["names"]), state["source"], state["stored_as"],
                   tuple(state["counts"]), state["rows"], None if state["weights"] is None else tuple(state["weights"]))

    def imbalance(self) -> float | None:
        """The largest class's rows over the smallest's (inf when one has none)."""
        if not self.counts:
            return None
        return max(self.counts) / min(self.counts) if min(self.counts) else float("inf")

    def describe(self) -> str:
        """One line: the task and its classes."""
        if self.problem_type == "regression":
            return "regression on one number"
        shown = ", ".join(self.names[:8]) + (f", ... ({len(self.names)} in all)" if len(self.names) > 8 else "")
        weighted = "" if self.weights is None else ", class-weighted"
        return f"{self.problem_type}, {self.num_labels} labels from {self.source}: {shown}{weighted}"


def from_config(data_cfg) -> Labels | None:
    """The label space the config alone gives (no data read): for `check --no-data`'s memory
    plan and checkpoints of older runs; None where only the data can tell."""
    if data_cfg.problem_type == "regression":
        return Labels("regression", (), "the task", NUMBERS)
    if data_cfg.label_names is not None:
        return Labels(data_cfg.problem_type, tuple(data_cfg.label_names), "data.label_names", IDS)
    if data_cfg.num_labels is not None:
        return Labels(data_cfg.problem_type, _placeholders(data_cfg.num_labels), "data.num_labels", IDS)
    return None


def _placeholders(count: int) -> tuple[str, ...]:
    return tuple(f"LABEL_{i}" for i in range(count))


# --- reading the label column ---------------------------------------------------------------


def _error(data_cfg, split_key: str, what: str) -> DataError:
    return DataError(f"data.label_field: column {data_cfg.label_field!r} in {split_key} {what}")


def _first(mask) -> int | None:
    """The first row where an Arrow boolean mask is true, or None."""
    import pyarrow.compute as pc

    found = pc.index(mask, True).as_py()
    return None if found < 0 else found


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


def _class_label_names(feature) -> list[str] | None:
    """A ClassLabel's names: the column's own, or its elements' (a list of ClassLabel)."""
    for candidate in (feature, getattr(feature, "feature", None)):
        names = getattr(candidate, "names", None)
        if names:
            return list(names)
    return None


def _values(column, data_cfg, split_key: str):
    """The column's labels as one flat Arrow array, and the row of each: the column itself for
    single_label and regression, the lists' elements for multi_label. Nulls are refused."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    null = _first(pc.is_null(column)) if column.null_count else None
    if null is not None:
        raise _error(data_cfg, split_key, f"has no label in row {null}")
    kind, problem = _kind(column.type), data_cfg.problem_type
    if kind not in (IDS, NAMES, NUMBERS, "lists"):  # a JSON column of mixed values, a struct, ...
        raise _error(data_cfg, split_key, f"holds values of type {kind}, not class ids, names, lists or numbers "
                                          "(are its rows of one kind?)")
    if problem == "multi_label":
        if kind != "lists":
            raise _error(data_cfg, split_key, f"holds {kind}, not lists: data.problem_type=multi_label reads a list "
                                              "of class names or ids per row (JSONL or Parquet: [\"a\", \"c\"])")
        values, rows = pc.list_flatten(column), pc.list_parent_indices(column)
        if values.null_count:
            raise _error(data_cfg, split_key, f"has a null label in the list of row {rows[_first(pc.is_null(values))]}")
        return values, rows
    if kind == "lists":
        raise _error(data_cfg, split_key, f"holds lists: for a set of classes per row, set data.problem_type="
                                          f"multi_label (data.problem_type is {problem})")
    if problem == "regression" and kind not in (IDS, NUMBERS):
        raise _error(data_cfg, split_key, f"holds {kind}: data.problem_type=regression needs numbers")
    if problem == "single_label" and kind == NUMBERS:
        raise _error(data_cfg, split_key, "holds numbers with fractions: single_label needs class ids (integers) "
                                          "or names (strings); for a number to predict, set "
                                          "data.problem_type=regression")
    return column, None


def resolve(train_ds, data_cfg) -> Labels:
    """The run's classes from the whole train split (a `datasets` split, read in Arrow); its
    counts and weights are `counted`'s."""
    import pyarrow.compute as pc

    column = train_ds.with_format("arrow")[data_cfg.label_field]
    values, _ = _values(column, data_cfg, "data.train_split")
    if data_cfg.problem_type == "regression":
        if pc.any(pc.is_nan(values.cast("float64"))).as_py():
            raise _error(data_cfg, "data.train_split", f"has NaN in row {_first(pc.is_nan(values.cast('float64')))}")
        return Labels("regression", (), "the task", NUMBERS)
    kind = _kind(values.type)
    feature_names = _class_label_names(train_ds.features.get(data_cfg.label_field))
    if data_cfg.label_names is not None:
        names, source = list(data_cfg.label_names), "data.label_names"
    elif feature_names is not None:
        names, source = feature_names, "ClassLabel"
    elif kind == NAMES:
        names, source = sorted(pc.unique(values).to_pylist()), "the train split"
    else:
        high = pc.max(values).as_py()
        count = data_cfg.num_labels if data_cfg.num_labels is not None else (0 if high is None else int(high) + 1)
        names, source = list(_placeholders(count)), "ids" if data_cfg.num_labels is None else "data.num_labels"
    if data_cfg.num_labels is not None and len(names) != data_cfg.num_labels:
        raise DataError(f"data.num_labels: {data_cfg.num_labels}, but the labels are {len(names)} "
                        f"({_shown(names)}, from {source})")
    if len(names) < 2:
        raise DataError(f"data.label_field: column {data_cfg.label_field!r} in data.train_split has "
                        f"{len(names)} class{'es' if len(names) != 1 else ''} ({_shown(names)}): "
                        f"{data_cfg.problem_type} needs 2 or more")
    labels = Labels(data_cfg.problem_type, tuple(map(str, names)), source, NAMES if kind == NAMES else IDS)
    class_ids(column, labels, data_cfg, "data.train_split")  # every train label is one of them
    return labels


def counted(labels: Labels, train_ds, data_cfg, train_cfg) -> Labels:
    """`labels` with the train split's (the rows that train: after a held-out validation
    share and data.max_train_samples) count of each class, and the class weights."""
    column = train_ds.with_format("arrow")[data_cfg.label_field]
    if labels.problem_type == "regression":
        return replace(labels, rows=len(column))
    ids = class_ids(column, labels, data_cfg, "data.train_split")
    with_counts = replace(labels, counts=tuple(int(n) for n in np.bincount(ids, minlength=labels.num_labels)),
                          rows=len(column))
    return replace(with_counts, weights=_weights(with_counts, train_cfg.class_weights))


def _shown(names: Sequence[str]) -> str:
    return ", ".join(map(str, names[:6])) + (", ..." if len(names) > 6 else "")


def class_ids(column, labels: Labels, data_cfg, split_key: str) -> np.ndarray:
    """The class id of every label in `column` (flat: multi_label's lists' elements), each
    checked to be one of `labels`: an unknown one is an error naming the value, the split and
    the row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values, rows = _values(column, data_cfg, split_key)
    kind = _kind(values.type)

    def row_of(i: int) -> int:
        return i if rows is None else rows[i].as_py()

    if labels.stored_as == NAMES:
        if kind != NAMES:
            raise _error(data_cfg, split_key, f"holds {kind}, and the train split names its labels")
        ids = pc.index_in(values, value_set=pa.array(labels.names))
        missing = _first(pc.is_null(ids)) if ids.null_count else None
        if missing is not None:
            where = "data.label_names" if labels.source == "data.label_names" else "the train split's labels"
            raise _error(data_cfg, split_key, f"has {values[missing].as_py()!r} in row {row_of(missing)}, which is not "
                                              f"one of {where} ({_shown(labels.names)})")
        return ids.to_numpy(zero_copy_only=False).astype(np.int64)
    if kind != IDS:
        raise _error(data_cfg, split_key, f"holds {kind}, and the train split holds class ids")
    ids = values.cast(pa.int64())
    outside = _first(pc.or_(pc.less(ids, 0), pc.greater_equal(ids, labels.num_labels))) if len(ids) else None
    if outside is not None:
        extremes = pc.min_max(ids)
        raise DataError(f"data.num_labels: {split_key} has labels in [{extremes['min']}, {extremes['max']}], "
                        f"outside [0, {labels.num_labels - 1}] (row {row_of(outside)})")
    return ids.to_numpy(zero_copy_only=False)


def check_split(ds, labels: Labels, data_cfg, split_key: str) -> None:
    """Every label of another split (validation, test) is one the run knows."""
    import pyarrow.compute as pc

    column = ds.with_format("arrow")[data_cfg.label_field]
    if labels.problem_type == "regression":
        values, _ = _values(column, data_cfg, split_key)
        nan = pc.is_nan(values.cast("float64"))
        if pc.any(nan).as_py():
            raise _error(data_cfg, split_key, f"has NaN in row {_first(nan)}")
        return
    class_ids(column, labels, data_cfg, split_key)


def single_label_ids(ds, labels: Labels, data_cfg) -> np.ndarray | None:
    """Each row's class id, for stratifying a split: single_label only, else None."""
    if labels.problem_type != "single_label":
        return None
    return class_ids(ds.with_format("arrow")[data_cfg.label_field], labels, data_cfg, "data.train_split")


def _weights(labels: Labels, setting: Any) -> tuple[float, ...] | None:
    """train.class_weights for `labels`: balanced from the train split's counts, or the list."""
    if setting is None:
        return None
    if setting != "balanced":
        if len(setting) != labels.num_labels:
            raise DataError(f"train.class_weights: expected {labels.num_labels} weights, one per label "
                            f"({_shown(labels.names)}), got {len(setting)}")
        return tuple(float(w) for w in setting)
    empty = [name for name, count in zip(labels.names, labels.counts, strict=True) if count == 0]
    if empty:
        raise DataError(f"train.class_weights: balanced weighs each class by its train rows, and "
                        f"{_shown(empty)} {'has' if len(empty) == 1 else 'have'} none")
    if labels.problem_type == "multi_label":
        everywhere = [name for name, count in zip(labels.names, labels.counts, strict=True) if count == labels.rows]
        if everywhere:
            raise DataError(f"train.class_weights: balanced weighs each label's positives against its negatives, "
                            f"and {_shown(everywhere)} is in every train row")
        return tuple((labels.rows - count) / count for count in labels.counts)
    return tuple(labels.rows / (labels.num_labels * count) for count in labels.counts)


# --- into the model's labels -----------------------------------------------------------------


def encode(values: list, problem_type: str, index: dict[str, int] | None, num_labels: int) -> list:
    """A batch of the column's labels as the model's: class ids (single_label), multi-hot rows
    of floats (multi_label), floats (regression). Run in the tokenizing map, on labels
    `class_ids` has checked; plain arguments, which `datasets` hashes into the cache's name."""
    if problem_type == "regression":
        return [float(v) for v in values]
    if problem_type == "single_label":
        return [index[v] for v in values] if index is not None else [int(v) for v in values]
    rows = []
    for row in values:
        hot = [0.0] * num_labels
        for value in row:
            hot[index[value] if index is not None else int(value)] = 1.0
        rows.append(hot)
    return rows


def keys(column) -> np.ndarray:
    """One int64 per row that changes with the row's label (the model's, after `encode`), for
    the data ledger (trainer/data.py): the class id; a number's bits; a multi-hot row packed."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_integer(column.type):
        return np.asarray(column.to_numpy(), dtype=np.int64).copy()
    if pa.types.is_floating(column.type):
        return np.asarray(column.to_numpy(), dtype=np.float64).view(np.int64).copy()
    width = len(column[0]) if len(column) else 0
    hot = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=bool).reshape(len(column), width)
    packed = np.packbits(hot, axis=1)
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 8))).view(np.uint64)
    powers = np.uint64(1_000_003) ** np.arange(packed.shape[1], dtype=np.uint64)
    return (packed * powers).sum(axis=1, dtype=np.uint64).view(np.int64)
