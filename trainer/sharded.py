"""A model sharded by FSDP2 (train.strategy=fsdp), as checkpoints and the export see it.

Its parameters are DTensors, each rank holding 1/N. A checkpoint keeps them so: each rank
writes its own shards with torch.distributed.checkpoint (DCP), which reshards them on load
for any world size. final/ is written the same way, in Hugging Face's safetensors format.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from trainer.errors import one_line


class ShardsError(Exception):
    """A DCP save, load or export that failed on some rank, raised on every rank."""


@contextmanager
def _reported() -> Iterator[None]:
    """DCP's failures as ShardsError, naming the first failing rank and its reason. DCP raises
    a CheckpointException, a BaseException that passes every `except Exception`, and whose
    text is every rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = min(e.failures.items(), key=lambda failure: failure[0])
        raise ShardsError(f"rank {rank}: {type(error).__name__}: {one_line(error)}") from None


def _trained_only():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False: the loaded state lacks the frozen weights by design; DCP itself
    # refuses a checkpoint that lacks a weight that trains.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


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
    with _reported():
        dcp.save(get_model_state_dict(model), storage_writer=writer)
    shutil.rmtree(folder / "sharded", ignore_errors=True)


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the trained weights (LoRA's adapters and head), whole and on the CPU on
    rank 0 (empty elsewhere): small enough to gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=options))  # no DTensor left


def unsharded_class_name(model: nn.Module) -> str:
    """The transformers class of a model FSDP2 has sharded (it subclasses it as FSDP<name>)."""
    return type(model).__name__.removeprefix("FSDP")


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, in_background: bool = False,
         group: dist.ProcessGroup | None = None) -> Future | None:
    """Collective: the state of what trains (the model's trained weights, the optimizer's
    state) into `folder` with DCP, each rank writing its own shards. A frozen weight (LoRA's
    base) is model.name's, loaded again on resume, as in a DDP checkpoint.

    `in_background`: only the copy into host memory happens now. DCP's async save writes in
    a thread, its collectives on `group` (a gloo group of its own), and returns a future
    for `wait`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
    state = {"model": model_state, "optimizer": optimizer_state}
    with _reported():
        if not in_background:
            dcp.save(state, checkpoint_id=str(folder))
            return None
        return cast(Future, dcp.async_save(state, checkpoint_id=str(folder), process_group=group))


def wait(write: Future) -> None:
    """Until a background save (save's future) is complete on every rank: every rank's
    shards and the metadata written. Raises ShardsError on every rank if any rank failed."""
    with _reported():
        write.result()


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Collective: `folder`'s state (save's) into the model, and the optimizer if given,
    resharded to this run's ranks whatever the world size that saved it. Every trained
    weight must be in it (DCP refuses a missing one); the frozen ones are left as loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if optimizer is None:
        model_state = get_model_state_dict(model, options=_trained_only())
        with _reported():
            dcp.load({"model": model_state}, checkpoint_id=str(folder))
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
        with _reported():
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    set_model_state_dict(model, model_state, options=_trained_only())
