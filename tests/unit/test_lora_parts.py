"""LoRA's parts in process: what trains, what a checkpoint holds and refuses, what the
optimizer holds, and LoRA's FLOPs. tests/e2e/test_lora.py runs it end to end."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from trainer import checkpoint, lora, optim
from trainer.errors import CheckpointError, ConfigError
from trainer.flops import FlopModel

HIDDEN, LAYERS, INTERMEDIATE, LABELS, R = 32, 2, 37, 3, 4


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=INTERMEDIATE, max_position_embeddings=64, num_labels=LABELS))


def model_cfg(**lora_settings):
    return OmegaConf.create({"lora": {"r": R, "alpha": 8.0, "dropout": 0.0, "target_modules": None, **lora_settings}})


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
    assert lora.describe(counts).startswith(f"{counts['trained_parameters']:,} of {counts['parameters']:,}")
    assert lora.describe(lora.parameter_counts(bert())).startswith("all ")


def test_without_lora_the_model_is_returned_as_it_is():
    model = bert()
    assert lora.apply(model, model_cfg(r=None)) is model


def test_a_checkpoint_holds_the_weights_that_train():
    full = bert()
    assert checkpoint.trained_tensors(full).keys() == full.state_dict().keys()
    adapted = lora.apply(bert(), model_cfg())
    assert sorted(checkpoint.trained_tensors(adapted)) == \
        sorted(name for name, p in adapted.named_parameters() if p.requires_grad)


def test_the_optimizer_holds_the_weights_that_train():
    adapted = lora.apply(bert(), model_cfg())
    train_cfg = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.0, "fused_adamw": False})
    held = [p for group in optim.optimizer(adapted, train_cfg).param_groups for p in group["params"]]
    assert [id(p) for p in held] == [id(p) for p in adapted.parameters() if p.requires_grad]


def test_a_checkpoint_of_another_model_or_lora_setting_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    save_file(checkpoint.trained_tensors(bert()), tmp_path / "full.safetensors")
    save_file(checkpoint.trained_tensors(lora.apply(bert(), model_cfg())), tmp_path / "lora.safetensors")

    adapted = lora.apply(bert(), model_cfg())
    refused = r"not this model's weights \(model.name, model.lora\): missing 10 .*; unexpected 41"
    with pytest.raises(CheckpointError, match=refused):
        checkpoint._load_model_file(adapted, tmp_path / "full.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \d+ \(.*lora_A"):
        checkpoint._load_model_file(lora.apply(bert(), model_cfg(target_modules=["query", "key"])),
                                    tmp_path / "lora.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint._load_model_file(bert(), tmp_path / "lora.safetensors")

    checkpoint._load_model_file(adapted, tmp_path / "lora.safetensors")  # its own kind loads


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
    from trainer import model as model_module

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
