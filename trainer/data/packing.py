"""Packed micro-batches (data.packing): a micro-batch's sequences laid end to end in as few rows
as fit its longest, so that no layer computes on padding beyond each row's tail. Which
samples share a row is `rows_of`'s; trainer/data/loaders.py's `PackedCollate` lays them out.

What makes a packed batch equal to a padded one, per token: each sequence's
positions restart at its first token; its token type ids are its own (text pairs); and
`sequence_ids` says which sequence of its row each token is of, so that attention stays
within it (trainer/model/packing.py makes the mask of them, on the device). The classifier
reads each sequence at its own first token (encoders) or its last (decoders): `pool_index`,
the flat index into the rows, one per sample, in the samples' order. So the labels, the
logits and the losses are the samples' own, in the order they came, whatever rows they took.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD_SEQUENCE = 0
"""`sequence_ids` of a row's padding: it attends to itself only, and nothing attends to it."""


@dataclass(frozen=True)
class Layout:
    """What a model family asks of a packed row (trainer/model/packing.py says it per family)."""

    pool_last: bool
    """The classifier reads each sequence's last token (decoders), not its first (encoders)."""
    position_offset: int = 0
    """The position id of each sequence's first token: RoBERTa's count from padding_idx + 1."""


def rows_of(lengths: list[int], capacity: int) -> list[list[int]]:
    """The samples (indices into `lengths`) of each row, first-fit by decreasing length: few
    rows, each filled to at most `capacity` tokens. Ties keep the samples' order, so the
    same micro-batch always packs the same way."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def is_packed(batch: dict) -> bool:
    return "pool_index" in batch
