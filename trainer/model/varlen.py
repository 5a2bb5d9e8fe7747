"""FlashAttention over packed rows, with no mask (model.sdpa_backend=flash with data.packing).

SDPA over a packed row's block-diagonal mask computes every row's width x width scores and
discards the masked ones, and FlashAttention, the fastest kernel, takes no mask at all. torch's
variable-length attention (torch.nn.attention.varlen, FlashAttention's varlen kernel) takes
the row's sequences instead, by their cumulative lengths (`cu_seqlens`, made by the collate
on the host): each sequence attends within itself, and nothing is computed across them.

The model is built with ATTENTION, registered with transformers' AttentionInterface and no
mask function of its own: transformers then makes no mask for it (masking_utils returns None
for an attention it has no mask function for), so it neither builds the block-diagonal mask
nor reads the position ids on the host to find packed sequences, a sync per step. Every
forward of such a model is packed (trainer/model/packing.py hands `cu_seqlens` down) but
FSDP's evaluation filler, a row with no padding, which plain SDPA runs exactly without a mask.
An unpacked padded batch would have no mask, so a model packing cannot run is refused
(packing.of_run), not padded.
"""

from __future__ import annotations

import inspect
from typing import cast

import torch

ATTENTION = "packed_varlen"
"""The model config's attn_implementation for this path (transformers takes any name with "flash" in it
for its own flash-attn integration, which it then looks for)."""


def register() -> str:
    """ATTENTION in transformers' registry (idempotent), before a model is built with it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    return ATTENTION


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              cu_seqlens: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query` (rows, heads, width, head_dim), `key` and
    `value` (rows, key heads, width, head_dim); the output is (rows, width, heads, head_dim).
    The kernel has no dropout: the model's attention dropout is not applied (model.sdpa_backend
    and docs/packing.md say so)."""
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, width, head_dim = query.shape
    # The kernel takes bf16 or fp16 alone, all three alike; under autocast SDPA casts them so,
    # but Llama's rotary embedding hands over fp32 queries and keys beside bf16 values.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    query, key, value = (t.to(dtype) for t in (query, key, value))
    if key.shape[1] != heads:  # grouped-query attention (Llama, Qwen2): a key head serves several query heads
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(rows * width, heads, head_dim)

    # The row width bounds every sequence's length: the kernel's max_q and max_k from a shape,
    # where the true longest would be a read of the device's cu_seqlens (a host sync).
    out = kernel(tokens(query), tokens(key), tokens(value), cu_seqlens, width, scaling,
                 bool(getattr(module, "is_causal", False)))
    return out.view(rows, width, heads, head_dim), None


def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int,
           scale: float | None, causal: bool) -> torch.Tensor:
    """torch's varlen_attn over (tokens, heads, head_dim); `scale` None: 1 / sqrt(head_dim)."""
    from torch.nn.attention.varlen import varlen_attn

    return cast(torch.Tensor, varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length,
                                          scale=scale, window_size=(-1, 0) if causal else (-1, -1)))


def available() -> str | None:
    """Why this torch cannot run the path (None: it can): `kernel` calls varlen_attn as torch
    2.11 and later define it (torch 2.10's took `is_causal`, and no `scale`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no variable-length attention (torch.nn.attention.varlen, 2.11+)"
    if not {"scale", "window_size"} <= set(inspect.signature(varlen_attn).parameters):
        return f"torch {torch.__version__}'s variable-length attention predates 2.11's (scale, window_size)"
    return None
