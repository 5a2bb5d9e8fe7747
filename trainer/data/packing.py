"""Packed micro-batches (data.packing): a micro-batch's sequences laid end to end in as few rows
as fit its longest, so that no layer computes on padding beyond each row's tail.

What makes a packed batch equal to a padded one is stated here, per token: each sequence's
positions restart at its first token; its token type ids are its own (text pairs); and
`sequence_ids` says which sequence of its row each token is of, so that attention stays
within it (trainer/model/packing.py makes the mask of them, on the device). The classifier
reads each sequence at its own first token (encoders) or its last (decoders): `pool_index`,
the flat index into the rows, one per sample, in the samples' order. So the labels, the
logits and the losses are the samples' own, in the order they came, whatever rows they took.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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


class PackedCollate:
    """Tokenized samples to one packed micro-batch of tensors: `input_ids`, `position_ids`,
    `sequence_ids`, `token_type_ids` where the samples have them, `pool_index` and
    `lengths` (one per sample, in order) and any other column (the labels) stacked as the
    padding collate stacks it.

    Rows are as wide as the micro-batch's longest sample (rounded up to `pad_to_multiple_of`),
    the width its padded batch has: the attention's masked blocks cost compute (a row's
    scores are width x width), so wider rows would trade the linear layers' saving for
    attention over blocks that are masked. At this width no layer computes more than padded,
    and the linear layers compute on fewer rows (benchmarks/RESULTS.md, 2026-11-29)."""

    def __init__(self, tokenizer, layout: Layout, pad_to_multiple_of: int | None):
        self.pad_values = {"input_ids": tokenizer.pad_token_id, "token_type_ids": tokenizer.pad_token_type_id}
        self.layout, self.multiple = layout, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        width = max(lengths)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        rows = rows_of(lengths, width)
        offset = self.layout.position_offset
        batch = {key: np.full((len(rows), width), pad, np.int64)
                 for key, pad in self.pad_values.items() if key in features[0]}
        positions = np.full((len(rows), width), offset, np.int64)
        sequences = np.full((len(rows), width), PAD_SEQUENCE, np.int64)
        pool_index = np.zeros(len(features), np.int64)
        for r, row in enumerate(rows):
            start = 0
            for n, i in enumerate(row, start=1):
                end = start + lengths[i]
                for key, packed in batch.items():
                    packed[r, start:end] = features[i][key]
                positions[r, start:end] = np.arange(offset, offset + lengths[i])
                sequences[r, start:end] = n
                pool_index[i] = r * width + (end - 1 if self.layout.pool_last else start)
                start = end
        out = {key: torch.from_numpy(packed) for key, packed in batch.items()}
        out |= {"position_ids": torch.from_numpy(positions), "sequence_ids": torch.from_numpy(sequences),
                "pool_index": torch.from_numpy(pool_index), "lengths": torch.tensor(lengths)}
        for key in features[0]:
            if key not in self.pad_values and key not in ("attention_mask", "special_tokens_mask"):
                out["labels" if key in ("label", "label_ids") else key] = torch.tensor([f[key] for f in features])
        return out


def is_packed(batch: dict) -> bool:
    return "pool_index" in batch
