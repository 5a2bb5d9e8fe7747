"""A classifier run over packed rows (trainer/data/packing.py): per family, how its sequences
are laid out, the mask that keeps each one to itself, and its head read at each sequence's
own token.

transformers' classifiers read one token per row (the first, or the last that is not a
pad), so a packed row must not go through their `forward`: the backbone runs over the rows,
and the family's own head modules over the tokens the samples are read at. The mask is
transformers' own (masking_utils), in the format the model's attention takes (SDPA's
booleans, eager's additive floats), made on the device from `sequence_ids` and handed to
the model ready, so that transformers reads nothing of it on the host. Padding at a row's
tail is a sequence of its own: no query is ever masked whole, which would make SDPA's
softmax NaN and its gradient with it.

A family is here once a test proves its packed logits, loss, gradients and trained weights
equal to padded ones (tests/unit/test_packing.py); any other is padded, as the run says.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.config.schema import DataConfig
from trainer.data.packing import Layout
from trainer.errors import ConfigError
from trainer.model import varlen

ENCODERS_WITH_HEAD = frozenset({"roberta"})
"""Their `classifier` takes the sequence output and reads its token 0 (RobertaClassificationHead)."""
DECODERS = frozenset({"gpt2", "llama", "qwen2", "mistral"})
"""Their `score` maps every token; the classifier reads each sequence's last."""
FAMILIES = frozenset({"bert"}) | ENCODERS_WITH_HEAD | DECODERS

log = logging.getLogger(__name__)


def unsupported(config) -> str | None:
    """Why packing cannot run this model (its config); None: it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type} is not one packing is proven on ({', '.join(sorted(FAMILIES))})"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", varlen.ATTENTION):
        return f"attention {config._attn_implementation}: packing takes sdpa or eager"
    return None


def of_run(data_cfg: DataConfig, config) -> Layout | None:
    """The layout of the run's packed rows (data.packing) for the model of `config`; None:
    padded, as asked, or because packing is not proven on this model (said in one line). A
    model built for FlashAttention (model.sdpa_backend=flash) has no mask to pad with: then
    packing it must be, or the run stops."""
    flash = getattr(config, "_attn_implementation", None) == varlen.ATTENTION
    if not data_cfg.packing and not flash:
        return None
    reason = "data.packing is false" if not data_cfg.packing else unsupported(config)
    if reason is not None and flash:
        raise ConfigError(f"model.sdpa_backend: flash runs packed batches only, but {reason}")
    if reason is not None:
        log.warning("data.packing: %s: its batches are padded instead", reason)
        return None
    return layout(config)


def layout(config) -> Layout:
    """How `config`'s family lays out a packed row."""
    model_type = config.model_type
    if model_type in DECODERS:
        return Layout(pool_last=True)
    if model_type in ENCODERS_WITH_HEAD:  # positions count from padding_idx + 1 (create_position_ids_from_input_ids)
        return Layout(pool_last=False, position_offset=config.pad_token_id + 1)
    return Layout(pool_last=False)


FSDP_METHOD = "packed_logits"
"""The packed forward as a method of the model's FSDP2 root, which gathers the root's own
weights (the embeddings, the head) around it as around its `forward` (`through_fsdp_root`)."""


def through_fsdp_root(model: nn.Module) -> None:
    """Under FSDP2 (the model, its root, sharded in place): the packed forward runs the
    backbone and the head without the root's `forward`, so it is registered with FSDP as a
    forward of the root's, or the root's weights would stay shards."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, FSDP_METHOD, types.MethodType(_logits, model))
    register_fsdp_forward_method(model, FSDP_METHOD)


def logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of each sample of a packed micro-batch, in the samples' order."""
    through_root = getattr(model, FSDP_METHOD, None)
    return through_root(inputs) if through_root is not None else _logits(model, inputs)


def _logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    bare = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's LoRA wraps it
    config = bare.config
    sequence_ids, pool_index = inputs["sequence_ids"], inputs["pool_index"]
    backbone = getattr(bare, bare.base_model_prefix)
    token_types = {"token_type_ids": inputs["token_type_ids"]} if "token_type_ids" in inputs else {}
    if config._attn_implementation == varlen.ATTENTION:  # no mask: each layer's attention takes the lengths
        attention = {"attention_mask": None, "cu_seqlens": inputs["cu_seqlens"]}
    else:
        attention = {"attention_mask": _mask(config, sequence_ids, next(bare.parameters()).dtype)}
    hidden = backbone(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], **attention,
                      **token_types)[0]
    tokens = hidden.flatten(0, 1).index_select(0, pool_index)
    return _head(bare, config.model_type)(tokens)


def _mask(config, sequence_ids: torch.Tensor, dtype: torch.dtype):
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask, packed_sequence_mask_function

    shape = torch.empty((*sequence_ids.shape, 0), dtype=dtype, device=sequence_ids.device)  # batch, length, dtype
    same_sequence = packed_sequence_mask_function(sequence_ids)
    if config.model_type in DECODERS:
        return create_causal_mask(config, shape, None, past_key_values=None, and_mask_function=same_sequence,
                                  allow_is_causal_skip=False)
    return create_bidirectional_mask(config, shape, None, and_mask_function=same_sequence,
                                     allow_is_bidirectional_skip=False)


def _head(model: Any, model_type: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The family's classifier over the tokens it reads, one row a sample: its own modules,
    applied as its forward applies them."""
    if model_type == "bert":  # BertPooler reads token 0, then dropout and the classifier
        return lambda tokens: model.classifier(model.dropout(model.bert.pooler(tokens[:, None])))
    if model_type in ENCODERS_WITH_HEAD:
        return lambda tokens: model.classifier(tokens[:, None])
    return model.score
