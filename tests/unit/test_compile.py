"""train.compile: each transformer block's forward compiled in place (trainer/model/pretrained.py), under
any strategy, FSDP2's included. Compiled here with torch's "eager" backend: the graphs and
graph breaks are dynamo's, whatever backend then makes kernels of them, and the steps are the
uncompiled ones, bit for bit, so that is asserted too. Inductor's kernels are the GPU check's
to time (benchmarks/gpu.sh)."""

from __future__ import annotations

import pytest
import torch
from support.perf_counts import CompileCounts
from support.runs import tiny_overrides

from trainer.cli import run_config
from trainer.data import labels
from trainer.model import pretrained
from trainer.runtime.environment import DistEnv
from trainer.train import build
from trainer.train.step import StepObserver

LENGTHS = [9, 16, 23, 5, 31]
"""Batch lengths as a run meets them: every one different."""


def test_null_compiles_on_a_gpu_for_long_runs_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pretrained.compiles(None, cuda, pretrained.COMPILE_AFTER_STEPS)
    assert not pretrained.compiles(None, cuda, pretrained.COMPILE_AFTER_STEPS - 1)
    assert not pretrained.compiles(None, cpu, 10**6)
    assert pretrained.compiles(True, cpu, 1) and not pretrained.compiles(False, cuda, 10**6)


def micro_batch(length: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (4, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 3])}


@pytest.fixture
def eager_backend(monkeypatch):
    monkeypatch.setattr(pretrained, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(cfg, dist_env) -> tuple[dict[str, torch.Tensor], torch.Tensor, CompileCounts]:
    """Steps of every length in LENGTHS, then an evaluation forward: the weights, the logits and
    what compiled."""
    torch.manual_seed(0)
    built = build.build(cfg, dist_env, torch.device("cpu"), labels.from_config(cfg.data), max_steps=20)
    with CompileCounts() as compiled:
        for step, length in enumerate(LENGTHS, start=1):
            assert built.step.settled([micro_batch(length, step)], step, StepObserver()).taken
        with torch.no_grad():
            batch = micro_batch(11, 99)
            logits = built.logits(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    weights = {name: p.detach().clone().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
               for name, p in built.model.named_parameters()}
    return weights, logits, compiled


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_blocks_take_three_graphs_for_any_lengths_and_train_the_same_bits(
        tiny_model, reviews, tmp_path, eager_backend, request, strategy):
    """A static graph for the first length, a dynamic one from the second on, one for evaluation:
    3 graphs for 5 lengths, none broken, the blocks sharing them; the same weights and logits
    as the uncompiled step's."""
    def cfg(compile_: bool):
        return run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path / "run", **{
            "train.batch_size": 4, "train.precision": "fp32", "train.strategy": strategy,
            "train.compile": compile_}))

    dist_env = request.getfixturevalue("one_rank_group") if strategy == "fsdp" else DistEnv()
    eager_weights, eager_logits, none = train(cfg(False), dist_env)
    weights, logits, compiled = train(cfg(True), dist_env)
    assert none.graphs == 0
    assert (compiled.graphs, compiled.graph_breaks) == (3, 0)
    assert torch.equal(logits, eager_logits)
    assert all(torch.equal(weights[name], eager_weights[name]) for name in eager_weights)
