"""A steady-state training step never makes the host wait for the device (trainer/train/step.py):
the loss check is decided and applied on the device and read a step later, and the model gets
an attention mask it need not read. Counted on the CPU (trainer/train/perf_counts.py), as the step
runs on a GPU (bf16, SDPA): the counts are deterministic, so they are asserted."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from support.perf_counts import StepCounts
from support.runs import tiny_overrides
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.cli.run_config import load as load_config
from trainer.data import labels
from trainer.data.loaders import PackedCollate
from trainer.faults import inject
from trainer.model import packing
from trainer.runtime.environment import DistEnv
from trainer.train import build
from trainer.train.step import StepObserver


def batches(padded: bool, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 9:] = 0
        mask[3, 12:] = 0
    return [{"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 3])}]


@pytest.fixture
def run_config(tiny_model, reviews, tmp_path):
    def make(model=tiny_model, **extra):
        return load_config(None, tiny_overrides(model, reviews, tmp_path / "run", **{
            "train.batch_size": 4, "train.precision": "bf16", "model.attn_implementation": "sdpa", **extra}))

    return make


def packed_batches(built, padded: bool, seed: int) -> list[dict[str, torch.Tensor]]:
    """`batches`' samples packed (data.packing)."""
    (batch,) = batches(padded, seed)
    lengths = batch["attention_mask"].sum(1).tolist()
    features = [{"input_ids": batch["input_ids"][i, :length].tolist(), "labels": i} for i, length in enumerate(lengths)]
    return [PackedCollate(built.tokenizer, packing.layout(built.config), None)(features)]


def counted_steps(built, steps: int = 4, packed: bool = False) -> list[dict]:
    """Each step's counts, counted from the first (what a step hands the next is known)."""
    taken = []
    made = [packed_batches(built, n % 2 == 0, n) if packed else None for n in range(1, steps + 1)]  # not counted
    with StepCounts() as counts:
        for n in range(1, steps + 1):
            step_batches = made[n - 1] or batches(padded=n % 2 == 0, seed=n)
            counts.host(step_batches)
            built.step(step_batches, n, StepObserver())
            taken.append(counts.take())
    return taken


@pytest.mark.parametrize("strategy", ["ddp", "lora", "packed"])
def test_a_steady_state_step_makes_no_host_sync(run_config, strategy):
    settings = {"lora": {"model.lora.r": 4}, "packed": {"data.packing": True}}.get(strategy, {})
    cfg = run_config(**settings)
    built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=8)
    steady = counted_steps(built, packed=strategy == "packed")[1:]  # the first settles nothing yet
    assert [step["sync_sites"] for step in steady] == [{}, {}, {}]
    # Padded and unpadded batches alike; the same ops every step, so a count may be asserted.
    assert steady[0]["by_op"] == steady[2]["by_op"] and steady[1]["syncs"] == 0


def test_an_fsdp_step_makes_no_host_sync(run_config, one_rank_group):
    cfg = run_config(**{"train.strategy": "fsdp"})
    built = build.build(cfg, one_rank_group, torch.device("cpu"), labels.from_config(cfg.data), max_steps=8)
    steady = counted_steps(built, steps=3)[1:]
    assert [step["sync_sites"] for step in steady] == [{}, {}]
    assert all(step["collectives"] == 1 for step in steady)  # the check's one all-reduce


def test_a_try_after_a_bad_one_is_aborted_and_trains_as_a_host_that_waited_would(run_config, dropout_model):
    """The verdict of a NaN try is read during the next try, which is then aborted, its random
    state given back; trying its batches again gives, bit for bit, what reading each verdict at
    once gives (with dropout on: the random state matters)."""
    cfg = run_config(dropout_model, **{"train.precision": "fp32"})

    def run(wait: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=8)
        inject.configure(DistEnv(), {"TRAINER_FAULT_NAN": "0:1"})
        inject.into_step(built.step)  # as the Trainer does
        try:
            if wait:
                assert built.step.settled(batches(True, 1), 1, StepObserver()).bad == "non-finite loss"
            else:
                assert built.step(batches(True, 1), 1, StepObserver()).outcome is None  # on its way
                second = built.step(batches(True, 2), 1, StepObserver())
                assert second.aborted and second.previous is not None and second.previous.bad == "non-finite loss"
            retried = built.step(batches(True, 2), 1, StepObserver())
            assert not retried.aborted and built.step.settle().taken
            assert built.step.settled(batches(False, 3), 2, StepObserver()).taken
        finally:
            inject.configure(DistEnv(), {})
        return {name: p.detach().clone() for name, p in built.model.named_parameters()}

    waited, pipelined = run(wait=True), run(wait=False)
    assert all(torch.equal(waited[name], pipelined[name]) for name in waited)


@pytest.mark.parametrize("padded", [True, False])
def test_the_mask_handed_to_the_model_gives_the_logits_of_its_2d_mask(run_config, padded):
    """AttentionMasks makes, from the host's copy, the mask transformers would make from the 2D
    one (none at all without padding): the same logits, bit for bit, with no sync asked."""
    from trainer.train.step import AttentionMasks

    cfg = run_config(**{"train.precision": "fp32"})
    model = build.load(cfg, DistEnv(), torch.device("cpu"), torch.float32, labels.from_config(cfg.data)).model.eval()
    batch = batches(padded, seed=5)[0]
    masks = AttentionMasks(model)
    assert masks.makes
    with torch.no_grad():
        as_2d = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with StepCounts() as counts:
            counts.host(batch)  # the loader's copy; the model reads the device's
            made = masks(batch["attention_mask"])(batch["attention_mask"].to("cpu"))
            handed = model(input_ids=batch["input_ids"], attention_mask=made).logits
    assert (made is None) == (not padded) and (made is None or made.ndim == 4)
    assert torch.equal(as_2d, handed) and counts.totals()["syncs"] == 0


class _WeightCasts(TorchDispatchMode):
    """How often each trained weight is cast (autocast's `_to_copy` of the parameter itself)."""

    def __init__(self, weights: dict[int, str]):
        super().__init__()
        self.weights, self.casts = weights, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.weights:
            self.casts[self.weights[id(args[0])]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recomputes", [False, True])
def test_a_step_casts_each_trained_weight_once_whatever_its_micro_batches(run_config, recomputes):
    """Under bf16 autocast, a step of 3 micro-batches casts each trained matrix to bf16 once,
    not once a micro-batch (trainer/train/step.py, _casts_kept), and trains the same bits as one that
    casts it anew each time. With activation checkpointing, each recompute casts again (the
    copies are not kept: they would outlive each block's backward)."""
    cfg = run_config(**{"model.gradient_checkpointing": recomputes})
    micro_batches = [batches(padded=i == 1, seed=i)[0] for i in range(3)]

    def run(keep: bool) -> tuple[Counter, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=8)
        if not keep:
            built.step._casts_kept = lambda micro_batches: contextlib.nullcontext()  # each micro-batch casts anew
        weights = {id(p): name for name, p in built.model.named_parameters() if p.requires_grad and p.dim() == 2}
        with _WeightCasts(weights) as mode:
            assert built.step.settled(micro_batches, 1, StepObserver()).taken
        return mode.casts, {name: p.detach().clone() for name, p in built.model.named_parameters()}

    kept, kept_weights = run(keep=True)
    anew, anew_weights = run(keep=False)
    matmuls = {name for name in anew if "embeddings" not in name}  # lookups read fp32 rows: no cast
    assert matmuls and set(kept) == matmuls
    if recomputes:  # a block's weights: cast by its forward and by its recompute, each micro-batch
        assert kept == anew and set(anew.values()) == {3, 6}
    else:
        assert set(anew.values()) == {3} and set(kept.values()) == {1}
    assert all(torch.equal(kept_weights[name], anew_weights[name]) for name in kept_weights)
