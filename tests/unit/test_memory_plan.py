"""The memory plan (trainer/preflight/memory.py) from config.json alone: its weights, gradients and
optimizer state equal a real model's and optimizer's tensors to the byte, and its activation
estimate is within the stated band of what the autograd graph really keeps."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.models import make_tiny_model

from trainer.cli.run_config import load as load_config
from trainer.data import labels
from trainer.model import lora
from trainer.preflight import memory
from trainer.runtime import devices
from trainer.runtime.environment import DistEnv
from trainer.train import build

FAMILIES = ["bert", "roberta", "deberta-v2", "modernbert", "gpt2", "llama", "qwen2", "mistral"]
TARGETS = {"modernbert": "[Wqkv]"}
"""peft's default targets, except where it has none."""


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    made: dict[str, object] = {}

    def tiny(family: str):
        if family == LARGE_VOCABULARY and family not in made:
            made[family] = with_vocabulary(tiny("llama"), 128_256, tmp_path_factory.mktemp(f"plan-{family}"))
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(f"plan-{family}"), 0.1, family)
        return made[family]

    return tiny


LARGE_VOCABULARY = "llama-128k-vocabulary"
"""The tiny Llama with Llama 3's 128,256 embedding rows: where the embedding, its gradient and
its optimizer state are most of a classifier's bytes."""


def with_vocabulary(model_dir, rows: int, out):
    """`model_dir`'s model, random-init with an embedding of `rows` rows, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.vocab_size = rows
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def run_config(model_dir, tmp_path, **overrides):
    settings = {"model.name": model_dir, "data.path": tmp_path, "data.num_labels": 5, "data.max_length": 64,
                "train.batch_size": 4, "train.max_steps": 1, "output_dir": tmp_path / "run", **overrides}
    return load_config("configs/demo.yaml", [f"{key}={value}" for key, value in settings.items()])


def trained_for_one_step(cfg):
    """The model and optimizer as a CPU training run builds them (trainer/train/build.py), after one
    real step, its gradients kept."""
    built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=1)
    ids = torch.randint(5, 100, (cfg.train.batch_size, cfg.data.max_length))
    built.step.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "labels": torch.zeros(len(ids), dtype=torch.long)}).backward()
    built.step.strategy.gradients_ready()  # the sparse embedding gradient, dense again
    built.step.optimizer.step()
    return built.model, built.step.optimizer


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("family", "settings"), [
    ("bert", {}), ("llama", {}), (LARGE_VOCABULARY, {}), ("bert", {"model.lora.r": 4}), ("gpt2", {"model.lora.r": 4}),
    ("llama", {"model.lora.r": 4, "train.precision": "bf16"}),  # a bf16 base (model.dtype auto)
    ("modernbert", {"model.lora.r": 4, "model.lora.target_modules": "[Wqkv]", "model.dtype": "bf16",
                    "train.precision": "bf16", "train.fused_adamw": False}),
], ids=["bert", "llama", LARGE_VOCABULARY, "bert-lora", "gpt2-lora", "llama-lora-bf16", "modernbert-lora-bf16-unfused"])
def test_weights_gradients_and_optimizer_state_are_exact_to_the_byte(tiny_models, tmp_path, family, settings):
    cfg = run_config(tiny_models(family), tmp_path, **settings)
    cpu = torch.device("cpu")
    plan = memory.make(cfg, labels.from_config(cfg.data), cpu)
    trained, optimizer = trained_for_one_step(cfg)
    assert plan.weights == nbytes(itertools.chain(trained.parameters(), trained.buffers()))
    assert plan.gradients == nbytes(p.grad for p in trained.parameters() if p.grad is not None)
    assert plan.optimizer == nbytes(t for state in optimizer.state.values() for t in state.values())
    assert (plan.parameters, plan.trained_parameters) == tuple(lora.parameter_counts(trained).values())
    assert plan.precision == lora.precisions(trained, devices.resolve_precision(cfg.train.precision, cpu))


def test_ddp_keeps_a_second_copy_of_the_gradients_without_bucket_views(tiny_models, tmp_path):
    bert = run_config(tiny_models("bert"), tmp_path)
    views = memory.make(bert, labels.from_config(bert.data), torch.device("cpu"))
    copies = memory.make(run_config(tiny_models("bert"), tmp_path, **{"ddp.gradient_as_bucket_view": False}),
                         labels.from_config(bert.data),
                         torch.device("cpu"))
    assert copies.gradients == 2 * views.gradients and copies.weights == views.weights


def saved_for_backward(module, batch: int, seq_len: int, compute: torch.dtype) -> int:
    """The bytes the autograd graph keeps for the backward of one forward: every tensor it
    saves, each storage once, the module's own weights not counted."""
    weights = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(5, 100, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32):
        module(input_ids=ids, labels=torch.zeros(batch, dtype=torch.long)).loss.float().backward()
    return sum(kept.values())


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_activation_estimate_is_within_its_stated_band(tiny_models, tmp_path, family, compute):
    """docs/memory.md: what the graph keeps is 0.5 to 1.8 times the estimate, with and
    without LoRA, for every tested family, with eager attention on CPU."""
    precision = "fp32" if compute == torch.float32 else "bf16"
    for with_lora in (False, True):
        lora_settings = {"model.lora.r": 4, "model.lora.target_modules": TARGETS.get(family, "null")} \
            if with_lora else {}
        cfg = run_config(tiny_models(family), tmp_path, **{"train.precision": precision, "data.max_length": 128,
                                                           **lora_settings})
        plan = memory.make(cfg, labels.from_config(cfg.data), torch.device("cpu"))
        trained, _ = trained_for_one_step(cfg)
        measured = saved_for_backward(trained.train(), cfg.train.batch_size, 128, compute)
        assert 0.5 <= measured / plan.activations <= 1.8, (with_lora, measured, plan.activations)


def test_activation_checkpointing_keeps_a_layer_input_per_layer_and_one_layer_in_full():
    from transformers import LlamaConfig

    llama = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
    llama.model_type = "llama"
    full = memory.activation_bytes(llama, 1024, torch.bfloat16, keeps_attention_probs=False, checkpointing=False)
    kept = memory.activation_bytes(llama, 1024, torch.bfloat16, keeps_attention_probs=False, checkpointing=True)
    layer = 6 * 8 * 4096 + 2 * 4 * 14336 + 2 * 4096  # x=6 under autocast, e=2, a gated MLP (m=4), the masks
    assert full == 1024 * (32 * layer + 2 * 6 * 4096)
    assert kept == 1024 * (32 * 6 * 4096 + layer + 2 * 6 * 4096)


def test_the_largest_micro_batch_fits_and_one_more_does_not():
    plan = memory.MemoryPlan(weights=10 * memory.GIB, gradients=0, optimizer=0, activations_per_sample=memory.GIB,
                             micro_batch=8, max_length=512, parameters=1, trained_parameters=1,
                             precision={"compute": "bf16", "trained": "fp32", "frozen": None})
    device = 80 * memory.GIB  # 72 GiB after the headroom
    largest = plan.largest_micro_batch(device)
    assert largest == 62
    for micro_batch, fits in ((largest, True), (largest + 1, False)):
        assert memory.MemoryPlan(**{**plan.__dict__, "micro_batch": micro_batch}).fits(device) is fits
    assert "does NOT fit" in memory.MemoryPlan(**{**plan.__dict__, "micro_batch": 70}).verdict(device)


@pytest.mark.parametrize("value", ["0", "-8", "eighty"])
def test_a_bad_gpu_size_names_the_argument(value):
    with pytest.raises(memory.ConfigError, match=r"^gpu_gib: "):
        memory.parse_gib(value)


MIB = 1024 * 1024


@pytest.mark.parametrize(("capability", "env", "expected"), [
    ((9, 0), {}, 32 * MIB + MIB),  # Hopper: torch's 32 MiB, and cuBLASLt's 1 MiB beside it
    ((8, 0), {}, 4096 * 1024 * 2 + 16 * 1024 * 8 + MIB),  # cuBLAS's default elsewhere, ":4096:2:16:8"
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MIB + MIB),  # torch's deterministic settings
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 2 * 128 * 1024),  # cuBLASLt's capped at cuBLAS's
    ((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, 8 * MIB + 128 * 1024 + MIB),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "garbage"}, 33 * MIB),  # torch warns and takes its default
    ((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, 32 * MIB),  # one workspace shared
    ((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}, 36 * MIB),  # KiB
], ids=["hopper", "ampere", "deterministic-4096", "deterministic-16", "explicit-default", "unparsable", "unified",
        "lt-size"])
def test_the_cublas_workspace_of_one_handle_is_torchs_documented_size(capability, env, expected):
    assert memory.cublas_workspace_bytes(capability, env) == expected


def test_a_step_holds_two_workspaces_on_cuda_and_none_on_cpu():
    """The forward's thread and autograd's each get one; `check` plans for an H100's."""
    assert memory.cublas_workspaces(torch.device("cpu")) == 0
    assert memory.cublas_workspaces(None, {}) == 2 * 33 * MIB
    assert memory.cublas_workspaces(None, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                           "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 2 * 32 * MIB


def test_the_caching_allocators_rounding():
    assert [memory.allocated_block(n) for n in (0, 1, 4, 512, 513, 3 * MIB + 1)] == \
        [512, 512, 512, 512, 1024, 3 * MIB + 512]
    # A 4-byte step count and a 2.25 MiB matrix: the matrix may sit unsplit in a block 1 MiB bigger.
    assert memory.allocated_bounds([4, 768 * 768 * 4]) == (512 + 768 * 768 * 4, 512 + 768 * 768 * 4 + MIB)
    # At most 1 MiB: the small pool's blocks are split to the rounded size.
    assert memory.allocated_bounds([MIB, MIB - 1]) == (2 * MIB, 2 * MIB)


def test_the_plan_for_a_gpu_holds_the_workspaces(tiny_models, tmp_path, monkeypatch):
    """`check` plans for a GPU: its static part and its lines count the workspaces; on CPU none."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    cfg = run_config(tiny_models("bert"), tmp_path)
    gpu = memory.make(cfg, labels.from_config(cfg.data))
    cpu = memory.make(cfg, labels.from_config(cfg.data), torch.device("cpu"))
    assert cpu.workspaces == 0 and gpu.workspaces == 2 * 33 * MIB
    assert gpu.static == gpu.weights + gpu.gradients + gpu.optimizer + 2 * 33 * MIB
    assert any(line.split()[:3] == ["cuBLAS", "66.0", "MiB"] for line in gpu.lines("an H100"))
    assert not any("cuBLAS" in line for line in cpu.lines("cpu"))
