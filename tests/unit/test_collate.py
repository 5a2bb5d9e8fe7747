"""trainer.data.loaders.Collate pads in numpy what transformers' DataCollatorWithPadding pads row by
row in Python: the same tensors, bit for bit, for every family's padding side, text pairs,
each task's labels and both padding policies."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.data.demo import review
from trainer.data.loaders import Collate


def tokenizer_of(folder, family: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:  # as trainer.model.pretrained gives GPT-2's and Llama's
        tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.padding_side == ("left" if family == "llama" else "right")
    return tokenizer


LABELS = {
    "single_label": lambda rng: rng.randrange(5),
    "regression": lambda rng: rng.uniform(-2, 2),
    "multi_label": lambda rng: [float(rng.random() < 0.3) for _ in range(4)],
}


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("task", sorted(LABELS))
def test_collate_equals_transformers_padding(tiny_model, decoder_models, family, pair, task):
    from transformers import DataCollatorWithPadding

    tokenizer = tokenizer_of(tiny_model if family == "bert" else decoder_models(family, 0.0), family)
    rng = random.Random(f"{family}{pair}{task}")
    for rows, multiple in [(1, None), (7, None), (33, 8), (64, 8), (5, 64)]:
        texts = [review(rng, rng.randrange(5))[:rng.randrange(1, 400)] for _ in range(rows)]
        pairs = [review(rng, rng.randrange(5)) for _ in range(rows)] if pair else None
        encoded = tokenizer(texts, pairs, truncation=True, max_length=48)
        features = [{**{k: v[i] for k, v in encoded.items()}, "labels": LABELS[task](rng)} for i in range(rows)]

        expected = dict(DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)(features))
        if family == "llama":
            expected["position_ids"] = (expected["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        got = Collate(tokenizer, multiple)(features)

        assert sorted(got) == sorted(expected), (rows, multiple)
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), (key, rows, multiple)
    assert ("token_type_ids" in got) == (family == "bert")
