"""The label space a model learns: `Labels`, the task (data.problem_type), its class names in
id order and where they came from, how the data stores them (class ids, names, multi-hot
rows, numbers), each class's count in the train split, and the class weights
(train.class_weights).

It is saved in every checkpoint, whose resume refuses data that gives another
(trainer/train/state.py), goes into final/'s config (id2label, problem_type) and
summary.json, and `check` prints it. trainer/data/labels.py reads it from the data, as the
task says its labels are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

IDS, NAMES, MULTI_HOT, NUMBERS, PAIRS = "ids", "names", "multi-hot rows", "numbers", "preference pairs"
"""How a label column stores its labels: class ids, class names (single_label, or lists of
them: multi_label), a row of 0 or 1 per label (multi_label), numbers (regression); or that
there is none, a row being a preference pair (pairwise)."""


@dataclass(frozen=True)
class Labels:
    problem_type: str
    names: tuple[str, ...]
    """The class names in id order (LABEL_0, ... for ids without names); () for regression."""
    source: str
    """Where the names come from: data.label_names, ClassLabel, the train split, ..."""
    stored_as: str
    """IDS, NAMES, MULTI_HOT or NUMBERS."""
    counts: tuple[int, ...] = ()
    """The train split's rows of each class (multi_label: the rows that hold it)."""
    rows: int = 0
    """The train split's rows."""
    weights: tuple[float, ...] | None = None
    """Each class's weight in the loss (train.class_weights), None: unweighted."""

    @property
    def num_labels(self) -> int:
        """The classification head's outputs: one per class, or the one number of a task with
        no classes (regression)."""
        return len(self.names) or 1

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
        if self.stored_as == PAIRS:
            return f"{self.problem_type}: one reward per text, learnt from preference pairs"
        if not self.names:
            return f"{self.problem_type} on one number"
        weighted = "" if self.weights is None else ", class-weighted"
        return f"{self.problem_type}, {self.num_labels} labels from {self.source}: {shown(self.names, 8)}{weighted}"

    def differences(self, other: Labels, among: Sequence[str] | None = None) -> list[str]:
        """What differs from `other`, field by field (of `among`, else all): `name: mine -> other's`."""
        names = [field.name for field in fields(self)] if among is None else among
        return [f"{name}: {_shown_value(getattr(self, name))} -> {_shown_value(getattr(other, name))}"
                for name in names if getattr(self, name) != getattr(other, name)]


SPACE = ("problem_type", "names", "stored_as")
"""The fields that give each class its id and the model its head: what a resume must keep."""


def placeholder_names(count: int) -> tuple[str, ...]:
    """The names of class ids without names, as transformers names them."""
    return tuple(f"LABEL_{i}" for i in range(count))


def shown(names: Sequence, most: int = 6) -> str:
    return ", ".join(map(str, names[:most])) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _shown_value(value: Any) -> str:
    return f"({shown(value)})" if isinstance(value, tuple) else str(value)
