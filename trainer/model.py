"""The model: a transformers sequence classifier and its tokenizer, from a hub id or a folder.

This is the bare model: checkpoints, evaluation and the final export use it, so no `module.`
(or `_orig_mod.`) prefix ever reaches a file. How the training step runs it across ranks
(DDP, DataParallel, torch.compile) is trainer/parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from trainer.errors import ConfigError


def _load_error(name: str, e: Exception) -> ConfigError:
    message = " ".join(str(e).strip().split("\n")[0].split())[:300]
    return ConfigError(f"model.name: {name}: {type(e).__name__}: {message}")


def from_hub(model_cfg: DictConfig) -> bool:
    """Whether the model comes from the hub (a download), not from a local folder."""
    return not Path(model_cfg.name).expanduser().exists()


def load_tokenizer(model_cfg: DictConfig):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_cfg.name)
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg.name, e) from None


def attention_for(model_cfg: DictConfig, device: torch.device) -> str:
    if model_cfg.attn_implementation != "auto":
        return model_cfg.attn_implementation
    return "sdpa" if device.type == "cuda" else "eager"


def load_model(model_cfg: DictConfig, num_labels: int, seed: int, device: torch.device) -> nn.Module:
    """The bare classifier on `device`. Seeded, so the new head is the same in every process and run."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    try:
        config = AutoConfig.from_pretrained(
            model_cfg.name, num_labels=num_labels, attn_implementation=attention_for(model_cfg, device)
        )
        if not model_cfg.pretrained:
            return AutoModelForSequenceClassification.from_config(config).to(device)
        # A classifier fine-tuned before with another label count gets a new head (the
        # load report names it), rather than an error.
        return AutoModelForSequenceClassification.from_pretrained(
            model_cfg.name, config=config, ignore_mismatched_sizes=True
        ).to(device)
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg.name, e) from None
