"""How a checkpoint holds the model and its optimizer: each strategy names its format
(trainer/strategies/), and a resume refuses a checkpoint of the other one before anything
loads (trainer/checkpoint/resume.py): the two don't convert.

- `WHOLE` (ddp, dp, one process): model.safetensors, the bare model's weights with no
  `module.` prefix, written by rank 0; under LoRA the weights that train alone
  (lora.trained_tensors). The optimizer's state goes into optimizer.pt with the LR schedule's
  and the loss scaler's.
- `SHARDED` (fsdp): `sharded/`, the model's and AdamW's state through
  torch.distributed.checkpoint (DCP), each rank writing its own shards and rank 0 the
  metadata. DCP reshards on load, so it too resumes at any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainer.errors import CheckpointError, describe
from trainer.model import lora

if TYPE_CHECKING:  # torch.distributed.checkpoint costs half a second to import
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.stateful import Stateful

COMMON = ("optimizer.pt", "rng.pt", "state.json", "config.yaml")
"""What every checkpoint holds beside the model's format (trainer/checkpoint/checkpointer.py)."""


class ShardsError(Exception):
    """A DCP save, load or export that failed on some rank, raised on every rank."""


@contextmanager
def dcp_failures() -> Iterator[None]:
    """DCP's failures as ShardsError, naming the first failing rank and its reason. DCP raises
    a CheckpointException, a BaseException that passes every `except Exception`, and whose
    text is every rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = min(e.failures.items(), key=lambda failure: failure[0])
        raise ShardsError(f"rank {rank}: {describe(error)}") from None


def kept_stager(model: nn.Module) -> AsyncStager:
    """DCP's stager for a run's background saves, kept from save to save (DCP's default is a
    new one each time): the host copies it makes of the state at the first save are
    overwritten at the next, so on a GPU they are page-locked once and for all. Into pageable
    memory the copy ran at ~1 GB/s, 1.4 s of training paused per bert-base save on an H200
    (benchmarks/RESULTS.md, 2026-11-28). The copies stay held between saves: the host memory
    each save's peak took anyway. Only the Checkpointer reuses it, after the previous
    background write has finished, so no write reads a copy being overwritten."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = next(model.parameters()).device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=on_gpu))


class Whole:
    name = "whole"
    required = ("model.safetensors", *COMMON)
    own = ("model",)
    """The states it stores itself; the Checkpointer puts the others in optimizer.pt."""
    collective = False
    """Whether every rank writes part of it (start_save)."""

    def start_save(self, tmp: Path, states: dict[str, Stateful], in_background: bool,
                   group: dist.ProcessGroup | None, stager: AsyncStager | None = None) -> Future | None:
        """Collective: what every rank writes of the model itself. Nothing: rank 0 writes it."""
        return None

    def rank_zero_tensors(self, states: dict[str, Stateful]) -> dict[str, dict[str, torch.Tensor]]:
        """The safetensors files rank 0 writes, by name: their tensors."""
        return {"model.safetensors": lora.trained_tensors(cast(nn.Module, states["model"]))}

    def load(self, path: Path, states: dict[str, Stateful]) -> None:
        self.load_weights(path, cast(nn.Module, states["model"]))

    def load_weights(self, path: Path, model: nn.Module) -> None:
        """model.safetensors into `model`, which must expect exactly those tensors
        (lora.trained_tensors): a file of another architecture, or of a run with other
        model.lora settings, is refused by name rather than half loaded."""
        from safetensors.torch import load_model

        file = path / "model.safetensors"
        # Straight to the model's device from the mapped file: no full copy in host memory per rank.
        device = next(model.parameters()).device
        missing, unexpected = load_model(model, str(file), strict=False, device=str(device))
        missing = sorted(set(missing) & set(lora.trained_tensors(model)))
        if missing or unexpected:
            names = "; ".join(f"{what} {len(keys)} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})"
                              for what, keys in (("missing", missing), ("unexpected", sorted(unexpected))) if keys)
            raise CheckpointError(f"{file}: not this model's weights (model.name, model.lora): {names}")


class Sharded:
    name = "sharded"
    folder = "sharded"
    """The DCP folder: the model's and the optimizer's shards."""
    required = (f"{folder}/.metadata", *COMMON)
    own = ("model", "optimizer")
    collective = True

    def start_save(self, tmp: Path, states: dict[str, Stateful], in_background: bool,
                   group: dist.ProcessGroup | None, stager: AsyncStager | None = None) -> Future | None:
        """Collective: the state of what trains (the model's trained weights, the optimizer's
        state) into tmp/sharded with DCP, each rank writing its own shards. A frozen weight
        (LoRA's base) is model.name's, loaded again on resume, as in a whole checkpoint.

        `in_background`: only the copy into host memory happens now, by `stager` (kept_stager).
        DCP's async save writes in a thread, its collectives on `group` (a gloo group of its
        own), and returns a future for `wait`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = cast(nn.Module, states["model"]), cast(torch.optim.Optimizer, states["optimizer"])
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
        state, where = {"model": model_state, "optimizer": optimizer_state}, str(tmp / self.folder)
        with dcp_failures():
            if not in_background:
                dcp.save(state, checkpoint_id=where)
                return None
            return cast(Future, dcp.async_save(state, checkpoint_id=where, process_group=group, async_stager=stager))

    @staticmethod
    def wait(write: Future) -> None:
        """Until a background save (start_save's future) is complete on every rank: every
        rank's shards and the metadata written. Raises ShardsError on every rank if any failed."""
        with dcp_failures():
            write.result()

    @staticmethod
    def rank_zero_tensors(states: dict[str, Stateful]) -> dict[str, dict[str, torch.Tensor]]:
        return {}

    def load(self, path: Path, states: dict[str, Stateful]) -> None:
        self._load(path, cast(nn.Module, states["model"]), cast(torch.optim.Optimizer, states["optimizer"]))

    def load_weights(self, path: Path, model: nn.Module) -> None:
        self._load(path, model)

    def _load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Collective: the shards into the model, and the optimizer if given, resharded to this
        run's ranks whatever the world size that saved them. Every trained weight must be in
        them (DCP refuses a missing one); the frozen ones are left as loaded."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        where = str(path / self.folder)
        try:
            if optimizer is None:
                model_state = get_model_state_dict(model, options=_trained_only())
                with dcp_failures():
                    dcp.load({"model": model_state}, checkpoint_id=where)
            else:
                model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
                with dcp_failures():
                    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=where)
                set_optimizer_state_dict(model, optimizer, optimizer_state)
            set_model_state_dict(model, model_state, options=_trained_only())
        except ShardsError as e:
            raise CheckpointError(f"{path}: {e}") from None


def _trained_only():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False: the loaded state lacks the frozen weights by design; DCP itself
    # refuses a checkpoint that lacks a weight that trains.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


WHOLE, SHARDED = Whole(), Sharded()
Format = Whole | Sharded


def of_checkpoint(path: Path) -> Format:
    """The format a checkpoint folder was written in."""
    return SHARDED if (path / SHARDED.folder).is_dir() else WHOLE
