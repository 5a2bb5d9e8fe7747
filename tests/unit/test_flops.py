"""The FLOP model of real (tiny, random-init) models, and where a device's peak comes from."""

from __future__ import annotations

import pytest
import torch

from trainer.train import flops
from trainer.train.flops import FlopModel, peak_flops

HIDDEN, LAYERS, INTERMEDIATE, LABELS = 32, 2, 37, 3


def test_bert_counts_its_linear_layers_not_its_embeddings():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=INTERMEDIATE, max_position_embeddings=64, num_labels=LABELS))
    per_layer = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE  # q, k, v, output; the MLP's two
    linear = LAYERS * per_layer + HIDDEN * HIDDEN + HIDDEN * LABELS  # the pooler, the classifier
    flop_model = FlopModel.of(model)
    assert flop_model == FlopModel(linear, LAYERS, HIDDEN)
    # forward 2 + backward 4 per weight and token; attention 12 x layers x hidden x s^2
    assert flop_model.train_flops(tokens=8, sum_squared_lengths=34) == 6 * linear * 8 + 12 * LAYERS * HIDDEN * 34


def test_gpt2s_conv1d_layers_count_as_linear():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    model = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=1000, n_embd=HIDDEN, n_layer=LAYERS, n_head=2, n_positions=64, num_labels=LABELS))
    # attention: qkv (3 h^2) and projection (h^2); MLP: h x 4h and back; the score head
    assert FlopModel.of(model) == FlopModel(LAYERS * 12 * HIDDEN * HIDDEN + HIDDEN * LABELS, LAYERS, HIDDEN)


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA L4", (121e12, "data sheet for NVIDIA L4")),
    ("NVIDIA L40", (181e12, "data sheet for NVIDIA L40")),
    ("NVIDIA L4X", (None, "unknown for NVIDIA L4X in bfloat16: set train.peak_tflops from its data sheet")),
])
def test_a_gpu_peak_is_looked_up_by_its_exact_name(monkeypatch, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == expected


def test_a_given_peak_wins():
    assert peak_flops(torch.device("cpu"), torch.float32, given_tflops=2.5) == (2.5e12, "train.peak_tflops")


def test_a_cpu_peak_is_measured():
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    assert peak > 0 and source == "measured: 1024^3 matmul on cpu, fp32"


@pytest.mark.parametrize("native", [True, False], ids=["avx512-bf16", "avx2"])
def test_a_cpu_peak_bounds_bf16_with_the_fp32_units_and_measures_no_emulation(monkeypatch, native):
    """An emulated bf16 matmul is a floor, not a peak (it gave an MFU of 363%), and slow to
    time: the fp32 one is measured always, bf16 only where the CPU has it natively."""
    measured = []
    speeds = {torch.float32: 2e9, torch.bfloat16: 5e9}
    monkeypatch.setattr(flops, "has_native_bf16", lambda device: native)
    monkeypatch.setattr(flops, "_measured_matmul_peak", lambda device, dtype: measured.append(dtype) or speeds[dtype])
    peak, source = peak_flops(torch.device("cpu"), torch.bfloat16)
    if native:
        assert measured == [torch.float32, torch.bfloat16] and peak == 5e9
        assert source == "measured: 1024^3 matmul on cpu, fp32 and bf16"
    else:
        assert measured == [torch.float32] and peak == 2e9 and source == "measured: 1024^3 matmul on cpu, fp32"
