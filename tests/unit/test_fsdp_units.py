"""FSDP2's units: each transformer block of every tested family is sharded on its own."""

from __future__ import annotations

import pytest
import torch

from trainer.model import pretrained

LAYERS = 3


def classifier(family: str):
    import transformers

    common = {"vocab_size": 100, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
              "num_labels": 3, "pad_token_id": 0}
    configs = {
        "bert": ("BertConfig", "BertForSequenceClassification", {"num_hidden_layers": LAYERS}),
        "deberta-v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", {"num_hidden_layers": LAYERS}),
        "modernbert": ("ModernBertConfig", "ModernBertForSequenceClassification", {"num_hidden_layers": LAYERS}),
        "llama": ("LlamaConfig", "LlamaForSequenceClassification",
                  {"num_hidden_layers": LAYERS, "num_key_value_heads": 1}),
        "gpt2": ("GPT2Config", "GPT2ForSequenceClassification",
                 {"n_layer": LAYERS, "n_embd": 32, "n_head": 2, "n_inner": 64}),
    }
    config_name, model_name, extra = configs[family]
    config = getattr(transformers, config_name)(**{**common, **extra})
    with torch.device("meta"):
        return getattr(transformers, model_name)(config)


@pytest.mark.parametrize(("family", "block"), [
    ("bert", "BertLayer"), ("deberta-v2", "DebertaV2Layer"), ("modernbert", "ModernBertEncoderLayer"),
    ("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")])
def test_the_blocks_are_the_transformer_layers(family, block):
    blocks = pretrained.transformer_blocks(classifier(family))
    assert [type(b).__name__ for b in blocks] == [block] * LAYERS
