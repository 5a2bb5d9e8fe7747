"""data.packing in process: a packed micro-batch trains what the padded one trains.

For every family packing runs (trainer/model/packing.py's FAMILIES), under both attentions a CPU
run takes and the FlashAttention path's (trainer/model/varlen.py, its CUDA kernel replaced by
`reference_kernel`: what is proven here is every layer's plumbing to it), full and LoRA, fp32
with dropout 0: seven samples of 1 to 48 tokens (BERT's as text
pairs), packed into rows of 48, against the same samples padded. Each sample's logits, the loss,
every gradient and the weights after 3 AdamW steps agree within 1e-5; what changes in one
sequence leaves every other sequence of its row bitwise alone.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from omegaconf import OmegaConf
from support.models import make_tiny_model

from trainer.data.loaders import Collate, PackedCollate
from trainer.data.packing import rows_of
from trainer.model import lora, packing, varlen
from trainer.strategies.base import LogitsUnderAutocast

LENGTHS = [12, 1, 48, 7, 31, 3, 20]
"""Packed into rows of 48: [48], [31, 12, 3, 1], [20, 7]."""
CAPACITY = 48
FAMILIES = sorted(packing.FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, object] = {}

    def folder(family: str):
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(f"packing-{family}"), 0.0, family)
        return made[family]

    return folder


def reference_kernel(query, key, value, cu_seqlens, max_length, scale, causal):
    """varlen.kernel's contract, one sequence at a time by SDPA's math: (tokens, heads, head_dim)."""
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == len(query)
    assert max(b - a for a, b in itertools.pairwise(bounds)) <= max_length
    for start, end in itertools.pairwise(bounds):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale).transpose(0, 1)
    return out


@pytest.fixture
def flash(monkeypatch):
    monkeypatch.setattr(varlen, "kernel", reference_kernel)


def load(folder, attention: str, with_lora: bool):
    """`attention` flash: the model as model.sdpa_backend=flash builds it (see `flash`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, attn_implementation=varlen.register() if attention == "flash" else attention,
        pad_token_id=tokenizer.pad_token_id)
    if with_lora:
        model = lora.apply(model, OmegaConf.create(
            {"dtype": "fp32", "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": None}}))
    return tokenizer, model.train()


def samples(tokenizer, pairs: bool, seed: int = 0) -> list[dict]:
    """Random ids (no pad among them) of LENGTHS, labels 0-4; text pairs' second halves typed 1."""
    generator = torch.Generator().manual_seed(seed)
    features = []
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(5, len(tokenizer), (length,), generator=generator)
        ids[ids == tokenizer.pad_token_id] = 5
        feature = {"input_ids": ids.tolist(), "labels": i % 5}
        if pairs:
            feature["token_type_ids"] = [0] * (length // 2) + [1] * (length - length // 2)
        features.append(feature)
    return features


def inputs(batch: dict) -> tuple[dict, torch.Tensor]:
    batch = dict(batch)
    batch.pop("lengths", None)
    return batch, batch.pop("labels")


def forward(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model_inputs, labels = inputs(batch)
    logits = LogitsUnderAutocast(model, "cpu", torch.float32)(**model_inputs)
    return logits, torch.nn.functional.cross_entropy(logits, labels)


def batches(family: str, tokenizer, model) -> tuple[dict, dict]:
    features = samples(tokenizer, pairs=family == "bert")
    padded = Collate(tokenizer, None)(features)
    packed = PackedCollate(tokenizer, packing.layout(model.config), None)(features)
    return padded, packed


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_batch_trains_what_the_padded_batch_trains(folders, family, attention, with_lora, flash):
    """flash: packed through varlen's path, against the same model padded through SDPA."""
    tokenizer, model = load(folders(family), attention, with_lora)
    padded, packed = batches(family, tokenizer, model)
    assert packed["input_ids"].shape[0] == 3 < padded["input_ids"].shape[0] == len(LENGTHS)

    models = {"padded": model, "packed": copy.deepcopy(model)}
    if attention == "flash":
        models["padded"].set_attn_implementation("sdpa")
    grads, logits = {}, {}
    for name, batch in (("padded", padded), ("packed", packed)):
        logits[name], loss = forward(models[name], batch)
        loss.backward()
        grads[name] = {n: p.grad.clone() for n, p in models[name].named_parameters() if p.grad is not None}
    torch.testing.assert_close(logits["packed"], logits["padded"], rtol=0, atol=1e-5)
    assert grads["packed"].keys() == grads["padded"].keys() and grads["padded"]
    for name, grad in grads["padded"].items():
        torch.testing.assert_close(grads["packed"][name], grad, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    # Adam takes a gradient of pure rounding noise (GPT-2's key bias, which softmax ignores: 0
    # by construction) up to a whole step of lr: at 1e-3 that noise alone moved a weight 9.6e-6
    # in 3 steps (2026-11-29), too near 1e-5 to hold on every CPU; at 1e-4 it is 10x inside.
    for name, batch in (("padded", padded), ("packed", packed)):
        trained = models[name]
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(3):
            optimizer.zero_grad()
            forward(trained, batch)[1].backward()
            optimizer.step()
    weights = dict(models["padded"].named_parameters())
    for name, weight in models["packed"].named_parameters():
        torch.testing.assert_close(weight, weights[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_changed_sequence_leaves_the_others_in_its_row_bitwise_alone(folders, family, attention, flash):
    tokenizer, model = load(folders(family), attention, with_lora=False)
    model.eval()
    features = samples(tokenizer, pairs=family == "bert")
    changed = copy.deepcopy(features)
    changed[0]["input_ids"] = samples(tokenizer, pairs=False, seed=1)[0]["input_ids"]  # 12 tokens, as before
    collate = PackedCollate(tokenizer, packing.layout(model.config), None)
    before, after = collate(features), collate(changed)
    width = before["input_ids"].shape[1]
    rows = (before["pool_index"] // width).tolist()
    row_mates = [i for i in range(len(LENGTHS)) if i != 0 and rows[i] == rows[0]]
    assert len(row_mates) == 3, rows  # 31, 3 and 1 tokens share the 12-token sample's row
    with torch.no_grad():
        logits_before, logits_after = forward(model, before)[0], forward(model, after)[0]
    assert not torch.equal(logits_before[0], logits_after[0])
    for i in range(1, len(LENGTHS)):
        assert torch.equal(logits_before[i], logits_after[i]), (family, i)


def test_rows_are_filled_first_fit_by_decreasing_length():
    assert rows_of(LENGTHS, CAPACITY) == [[2], [4, 0, 5, 1], [6, 3]]
    assert rows_of([5, 5, 5], 16) == [[0, 1, 2]]
    assert rows_of([8, 8], 8) == [[0], [1]]


def test_a_family_packing_is_not_proven_on_is_padded_and_the_run_says_so(folders, caplog):
    """DeBERTa-v2 reads its samples through a pooler of its own: its batches stay padded."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folders("deberta-v2"), attn_implementation="sdpa")
    with caplog.at_level("WARNING", logger="trainer.model.packing"):
        assert packing.of_run(OmegaConf.create({"packing": True}), config) is None
    said = ("data.packing: model type deberta-v2 is not one packing is proven on (bert, gpt2, llama, mistral, qwen2, "
            "roberta): its batches are padded instead")
    assert caplog.messages == [said]
    bert = AutoConfig.from_pretrained(folders("bert"), attn_implementation="sdpa")
    assert packing.of_run(OmegaConf.create({"packing": True}), bert) == packing.Layout(pool_last=False)
