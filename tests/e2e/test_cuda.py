"""The CUDA path, on a real GPU: what no CPU test can reach.

Skipped where torch sees no GPU (CI has none; pytest shows the skip and its reason). On a GPU
host, `python -m pytest tests/e2e/test_cuda.py` runs them; benchmarks/RESULTS.md records the
runs on an H100. One GPU is enough: several gloo ranks share it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compare_weights, locally, run, tiny_overrides, train, trainer_command, weights
from support import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 40


def test_one_nccl_rank_trains_on_the_gpu_in_bf16_with_sdpa(tiny_model, reviews, tmp_path):
    overrides = tiny_overrides(tiny_model, reviews, tmp_path, **{
        "train.precision": "auto", "model.attn_implementation": "auto", "train.max_steps": 8,
        "checkpoint.every": 4})
    result = train(overrides, nproc=1)
    assert "on cuda:0 (nccl)" in result.output and "precision bfloat16" in result.output
    assert "attention sdpa" in result.output
    assert all(r["memory/peak_gib"] > 0 for r in read_metrics(tmp_path) if "loss" in r)

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").cuda().eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[101, 2307, 102]], device="cuda")).logits
    assert logits.shape == (1, 5) and torch.isfinite(logits).all()


@pytest.mark.parametrize("batch_size, grad_accum", [(8, 1), (4, 2)], ids=["2x8", "2x4-accum2"])
def test_gloo_ranks_sharing_the_gpu_match_one_process(tiny_model, reviews, tmp_path, batch_size, grad_accum):
    """2 ranks x b on one GPU, gradients all-reduced by gloo through host memory, equal one
    process x 2b on the same GPU, in fp32 (matmuls without TF32: torch's default)."""
    single = tmp_path / "single"
    train(tiny_overrides(tiny_model, reviews, single, **{"train.batch_size": 16, "train.max_steps": STEPS}),
          nproc=None)
    ranks = tmp_path / "ranks"
    result = train(tiny_overrides(tiny_model, reviews, ranks, **{
        "train.batch_size": batch_size, "train.grad_accum": grad_accum, "train.max_steps": STEPS,
        "dist.backend": "gloo"}), nproc=2)
    assert "on cuda:0 (gloo)" in result.output
    assert compare_weights(weights(tiny_model), weights(ranks, STEPS)).max_abs > 1e-2  # it trained
    assert compare_weights(single, ranks, STEPS).max_abs <= 1e-5


def test_kill_and_resume_on_the_gpu_is_bitwise_with_deterministic_kernels(reference_run, dropout_model, reviews,
                                                                          tmp_path):
    """As tests/e2e/test_resume.py, on CUDA, with the GPU's defaults (asynchronous checkpoints)
    and train.deterministic: without it, atomics in CUDA kernels (embedding backward) make
    even two uninterrupted runs differ in the last bits."""
    options = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 5, "train.log_every": 5,
               "dist.backend": "gloo", "train.deterministic": True}
    uninterrupted = reference_run(locally(2), dropout_model, **options).run
    resumed = tmp_path / "resumed"
    overrides = tiny_overrides(dropout_model, reviews, resumed, **options)
    killed = run(trainer_command(overrides, nproc=2), env={"TRAINER_FAULT_SIGKILL": "1:23"})
    assert killed.returncode != 0 and "(in the background)" in killed.output
    result = train(overrides)
    assert f"resumed from {resumed / 'checkpoints' / 'step-20'}" in result.output
    assert not compare_weights(uninterrupted, resumed, STEPS).differing


def test_fp16_with_its_loss_scaler_trains_on_the_gpu(tiny_model, reviews, tmp_path):
    """What `precision: auto` picks on a V100 or T4, forced here: fp16 autocast and a
    GradScaler on CUDA; an injected overflow at step 3 is skipped and halves the scale."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path, **{
        "train.precision": "fp16", "train.max_steps": 8, "train.log_every": 1})
    result = train(overrides, nproc=1, env={"TRAINER_FAULT_OVERFLOW": "*:3"})
    assert "on cuda:0 (nccl)" in result.output and "precision float16" in result.output
    scales = {r["step"]: r["loss_scale"] for r in read_metrics(tmp_path) if "loss_scale" in r}
    assert scales == {step: 65536.0 if step < 3 else 32768.0 for step in range(1, 9)}
