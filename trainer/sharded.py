"""A model sharded by FSDP2 (train.strategy=fsdp), as checkpoints and the export see it.

Its parameters are DTensors, each rank holding 1/N. A checkpoint keeps them so: each rank
writes its own shards with torch.distributed.checkpoint (DCP), which reshards them on load
for any world size. final/ is written the same way, in Hugging Face's safetensors format.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def export(folder: Path, model: nn.Module) -> None:
    """Collective: the model as Hugging Face safetensors in `folder` (which exists), through
    DCP's Hugging Face writer: each rank writes its own shards, then rank 0 merges them
    tensor by tensor into model-*.safetensors and its index, never holding the whole model.
    The per-rank files are removed; the config and tokenizer are the caller's to add."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    writer = HuggingFaceStorageWriter(path=str(folder), save_distributed=True, enable_consolidation=True)
    dcp.save(get_model_state_dict(model), storage_writer=writer)
    shutil.rmtree(folder / "sharded", ignore_errors=True)


def unsharded_class_name(model: nn.Module) -> str:
    """The transformers class of a model FSDP2 has sharded (it subclasses it as FSDP<name>)."""
    return type(model).__name__.removeprefix("FSDP")


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: the model's and the optimizer's state into `folder` with DCP, each rank
    writing its own shards (a model that isn't sharded: rank 0 writes it once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Collective: `folder`'s state (save's) into the model, and the optimizer if given,
    resharded to this run's ranks whatever the world size that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if optimizer is None:
        model_state = get_model_state_dict(model)
        dcp.load({"model": model_state}, checkpoint_id=str(folder))
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    set_model_state_dict(model, model_state)
