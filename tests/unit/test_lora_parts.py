"""LoRA's parts in process: what trains, what a checkpoint holds and refuses, what the
optimizer holds, and LoRA's FLOPs. tests/e2e/test_lora.py runs it end to end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainer.checkpoint import formats
from trainer.cli import run_config
from trainer.errors import CheckpointError, ConfigError
from trainer.model import lora, optim
from trainer.train.flops import FlopModel

HIDDEN, LAYERS, INTERMEDIATE, LABELS, R = 32, 2, 37, 3, 4


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=INTERMEDIATE, max_position_embeddings=64, num_labels=LABELS))


def model_cfg(dtype: str = "auto", **lora_settings):
    return OmegaConf.create({"dtype": dtype,
                             "lora": {"r": R, "alpha": 8.0, "dropout": 0.0, "target_modules": None, **lora_settings}})


def test_lora_trains_its_adapters_and_the_head_alone():
    adapted = lora.apply(bert(), model_cfg())
    trained = sorted(name for name, p in adapted.named_parameters() if p.requires_grad)
    # peft's default for BERT: query and value; the head (classifier) in full
    adapters = [f"base_model.model.bert.encoder.layer.{i}.attention.self.{m}.lora_{ab}.default.weight"
                for i in range(LAYERS) for m in ("query", "value") for ab in "AB"]
    head = [f"base_model.model.classifier.modules_to_save.default.{p}" for p in ("bias", "weight")]
    assert trained == sorted(adapters + head)
    counts = lora.parameter_counts(adapted)
    assert counts["trained_parameters"] == LAYERS * 2 * 2 * R * HIDDEN + HIDDEN * LABELS + LABELS
    fp32 = {"compute": "fp32", "trained": "fp32", "frozen": "fp32"}
    assert lora.describe(counts, fp32).startswith(f"{counts['trained_parameters']:,} of {counts['parameters']:,}")
    assert lora.describe(lora.parameter_counts(bert()), {**fp32, "frozen": None}).startswith("all ")


@pytest.mark.parametrize(("setting", "compute", "stored"), [
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
    ("auto", torch.float16, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp32", torch.bfloat16, torch.float32)])
def test_the_frozen_base_is_bf16_where_the_run_computes_in_bf16(setting, compute, stored):
    assert lora.frozen_dtype(model_cfg(dtype=setting), compute) == stored
    assert lora.frozen_dtype(model_cfg(dtype=setting, r=None), compute) == torch.float32  # nothing frozen


def test_a_bf16_base_where_auto_precision_is_not_bf16_names_both_keys():
    with pytest.raises(ConfigError, match=r"^model.dtype: bf16 weights need bf16 compute, but train.precision=auto "
                                          r"is fp16 on this device"):
        lora.frozen_dtype(model_cfg(dtype="bf16"), torch.float16)


def test_over_a_bf16_base_what_trains_and_its_optimizer_state_are_fp32():
    adapted = lora.apply(bert().to(torch.bfloat16), model_cfg())
    trained = {p.dtype for p in adapted.parameters() if p.requires_grad}
    frozen = {p.dtype for name, p in adapted.named_parameters()
              if not p.requires_grad and ".original_module." not in name}
    assert (trained, frozen) == ({torch.float32}, {torch.bfloat16})
    assert lora.precisions(adapted, torch.bfloat16) == {"compute": "bf16", "trained": "fp32", "frozen": "bf16"}
    assert "kept in fp32, the frozen rest in bf16; computes in bf16" in \
        lora.describe(lora.parameter_counts(adapted), lora.precisions(adapted, torch.bfloat16))
    optimizer = optim.optimizer(adapted, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.0, "fused_adamw": False}))
    batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]), "labels": torch.tensor([1])}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapted(**batch).loss.backward()
    optimizer.step()
    moments = [state[k] for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_without_lora_the_model_is_returned_as_it_is():
    model = bert()
    assert lora.apply(model, model_cfg(r=None)) is model


def test_a_checkpoint_holds_the_weights_that_train():
    full = bert()
    assert lora.trained_tensors(full).keys() == full.state_dict().keys()
    adapted = lora.apply(bert(), model_cfg())
    assert sorted(lora.trained_tensors(adapted)) == \
        sorted(name for name, p in adapted.named_parameters() if p.requires_grad)


def test_the_optimizer_holds_the_weights_that_train():
    adapted = lora.apply(bert(), model_cfg())
    train_cfg = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.01, "fused_adamw": False})
    groups = optim.optimizer(adapted, train_cfg).param_groups
    held = [p for group in groups for p in group["params"]]
    assert sorted(map(id, held)) == sorted(id(p) for p in adapted.parameters() if p.requires_grad)
    names = {id(p): name for name, p in adapted.named_parameters()}
    decayed = [names[id(p)] for p in groups[0]["params"]]
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert all("lora_" in name or name.endswith("classifier.modules_to_save.default.weight") for name in decayed)


def test_a_checkpoint_of_another_model_or_lora_setting_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    full, adapters = tmp_path / "full", tmp_path / "lora"
    for folder, model in ((full, bert()), (adapters, lora.apply(bert(), model_cfg()))):
        folder.mkdir()
        save_file(lora.trained_tensors(model), folder / "model.safetensors")

    adapted = lora.apply(bert(), model_cfg())
    refused = r"not this model's weights \(model.name, model.lora\): missing 10 .*; unexpected 41"
    with pytest.raises(CheckpointError, match=refused):
        formats.WHOLE.load_weights(full, adapted)
    with pytest.raises(CheckpointError, match=r"missing \d+ \(.*lora_A"):
        formats.WHOLE.load_weights(adapters, lora.apply(bert(), model_cfg(target_modules=["query", "key"])))
    with pytest.raises(CheckpointError, match="missing"):
        formats.WHOLE.load_weights(adapters, bert())

    formats.WHOLE.load_weights(adapters, adapted)  # its own kind loads


def test_target_modules_that_match_nothing_name_the_key():
    refused = r"^model.lora.target_modules: \['no_such_layer'\] adapt no layer of this 'bert' model"
    with pytest.raises(ConfigError, match=refused):
        lora.apply(bert(), model_cfg(target_modules=["no_such_layer"]))


def test_merged_weights_give_the_adapted_models_logits():
    adapted = lora.apply(bert(), model_cfg()).eval()
    for name, p in adapted.named_parameters():
        if "lora_B" in name:  # zero at init, which would make the merge trivially right
            torch.nn.init.normal_(p)
    inputs = {"input_ids": torch.tensor([[1, 5, 9, 2], [1, 7, 2, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    with torch.no_grad():
        expected = adapted(**inputs).logits
        merged = lora.merged(adapted)
        assert type(merged).__name__ == "BertForSequenceClassification"
        assert not [name for name in merged.state_dict() if "lora" in name or "modules_to_save" in name]
        torch.testing.assert_close(merged(**inputs).logits, expected, rtol=0, atol=1e-5)


def test_frozen_linear_layers_cost_4_flops_per_weight_and_token_not_6():
    adapted = lora.apply(bert(), model_cfg())
    per_layer = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE
    frozen = LAYERS * per_layer + HIDDEN * HIDDEN  # the base's layers and the pooler
    trained = LAYERS * 2 * 2 * R * HIDDEN + HIDDEN * LABELS  # adapters (A and B of q, v), the head
    assert FlopModel.of(adapted) == FlopModel(trained, LAYERS, HIDDEN, frozen)
    assert FlopModel.of(adapted).train_flops(tokens=8, sum_squared_lengths=0) == (6 * trained + 4 * frozen) * 8


def test_a_family_without_peft_defaults_names_the_key_to_set():
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    model = ModernBertForSequenceClassification(ModernBertConfig(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        num_labels=LABELS, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: peft has no default for model family "
                                          r"'modernbert'; name the linear layers"):
        lora.apply(model, model_cfg())
    adapted = lora.apply(model, model_cfg(target_modules=["Wqkv"]))  # ModernBERT's fused projection
    assert any("Wqkv.lora_A" in name for name, _ in adapted.named_parameters())


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_each_layer_in_the_backward(with_lora):
    from trainer.model import pretrained as model_module

    model = bert()
    if with_lora:
        model = lora.apply(model, model_cfg())
    model_module.use_gradient_checkpointing(model)
    model.train()
    layer = (model.get_base_model() if with_lora else model).bert.encoder.layer[0]
    calls = []
    # A module inside the layer: transformers checkpoints the layer's forward, not its __call__
    layer.attention.register_forward_hook(lambda module, args, output: calls.append(torch.is_grad_enabled()))
    logits = model(input_ids=torch.tensor([[1, 5, 9, 2]]), attention_mask=torch.ones(1, 4, dtype=torch.long)).logits
    assert len(calls) == 1
    logits.sum().backward()
    assert len(calls) == 2  # the backward ran the layer again: its activations were not kept


def test_every_module_of_the_head_trains_in_full():
    """DeBERTa-v2's head is a pooler and the classifier, both new at load time: a frozen
    pooler would stay random (peft's own list, `classifier` and `score`, misses it). The base
    model's own modules (BERT's pooler, inside `bert`) stay frozen."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    deberta = DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        num_labels=LABELS))
    adapted = lora.apply(deberta, model_cfg())
    trained = {name.split(".")[2] for name, p in adapted.named_parameters() if p.requires_grad and "lora_" not in name}
    assert trained == {"pooler", "classifier"}
    assert lora.head_modules(bert()) == ["classifier"]


def _written_pages_of(file_name: str) -> int:
    """KiB of this process's mappings of `file_name` that it has written to (copy-on-write
    pages, private to it): 0 while every page is still the file's, shared through the page cache."""
    written, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(file_name)
        elif inside and fields[0] in ("Private_Dirty:", "Anonymous:"):
            written += int(fields[1])
    return written


def test_ddp_leaves_the_frozen_base_in_the_shared_page_cache(tiny_model, tmp_path):
    """The ranks of a node map model.name's safetensors file, and share its pages. DDP's
    start-up broadcast of the frozen base would write over each rank's mapping, a private
    copy of the base per rank; it broadcasts only what trains, and writes no page of the file."""
    import torch.distributed as dist

    from trainer.data import labels
    from trainer.runtime.environment import DistEnv
    from trainer.strategies import registry
    from trainer.train import build

    cfg = run_config.load("configs/demo.yaml", [f"model.name={tiny_model}", f"data.path={tmp_path}", "model.lora.r=4",
                                            f"output_dir={tmp_path / 'run'}", "train.precision=fp32"])
    cpu = torch.device("cpu")
    adapted = build.load(cfg, DistEnv(), cpu, torch.float32, labels.from_config(cfg.data)).model
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith("model.safetensors") for line in maps)  # memory-mapped, as on a node
    # The session's fixture wrote the file moments ago: until the kernel writes its pages back,
    # they count as dirty in this process's mapping too, and a write-back during the test would
    # look like pages given back (the test failed so on a loaded machine). Flushed first.
    with (tiny_model / "model.safetensors").open("rb") as written:
        os.fsync(written.fileno())
    loaded = _written_pages_of("model.safetensors")  # what loading itself wrote (none, or a few pages)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        strategy = registry.of(cfg)
        strategy.parallelize(adapted, DistEnv(master_addr="localhost"), cpu, torch.float32)
        assert strategy.ddp is not None
        assert _written_pages_of("model.safetensors") == loaded
    finally:
        dist.destroy_process_group()
