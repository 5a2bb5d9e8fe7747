"""The one checkpointer: every saved state of the run into `output_dir/checkpoints/step-N/`,
and back, on any world size that divides the run's global batch.

A checkpoint holds (trainer/checkpoint/store.py: how it is published, verified and pruned):
- the model, and in the sharded format the optimizer too, in its strategy's format
  (trainer/checkpoint/formats.py): model.safetensors, or DCP shards under `sharded/`
- optimizer.pt        every other state (the optimizer, the LR schedule, the fp16 loss
                      scaler), loaded with weights_only=True
- rng.pt              every rank's RNG streams (trainer/checkpoint/rng.py)
- state.json          where the run is (trainer/train/state.py)
- config.yaml         the resolved config of the run (loading.to_yaml)
- per-rank/rank-N.pt  with ddp.comm_hook=powersgd: each rank's own PowerSGD state (its error
                      feedback), written by that rank
- COMPLETE            written last: the sha256 of every file above

Every state is a `Stateful` (state_dict / load_state_dict, as DCP takes them), handed over in
one dict by name: "model", "optimizer", "scheduler", "scaler", "train" and, per rank,
"comm_hook". With `async_save`, training pauses only while the state is copied to host memory
(trainer/checkpoint/writer.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainer import files
from trainer.checkpoint import formats
from trainer.checkpoint.rng import ProcessRNG
from trainer.checkpoint.store import Store, verify
from trainer.checkpoint.writer import Write, host_copy
from trainer.errors import CheckpointError, describe
from trainer.faults import inject
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:  # torch.distributed.checkpoint costs half a second to import
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger(__name__)

TRAIN = "train"
"""The train state, saved as state.json."""
PER_RANK_STATES = ("comm_hook",)
"""States that differ per rank (PowerSGD's error feedback): each rank writes its own file."""
PER_RANK = "per-rank"
"""Their folder."""


class _StateDict:
    """A model stand-in for safetensors' save_model, which wants `.state_dict()`: it drops
    the duplicate names of shared tensors and records them in the file's metadata."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def load_weights(path: Path, model: nn.Module) -> None:
    """A verified checkpoint's weights into `model` (the bare one, sharded or not), in place."""
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint: {path}: {problem}")
    try:
        formats.of_checkpoint(path).load_weights(path, model)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {e}") from None


class Checkpointer:
    def __init__(self, output_dir: str, keep: int, dist_env: DistEnv, async_save: bool = False,
                 checkpoint_format: formats.Format = formats.WHOLE):
        self.store = Store(Path(output_dir) / "checkpoints")
        self.root = self.store.root
        self.keep = keep
        self.dist_env = dist_env
        self.format = checkpoint_format
        """How the model (and, sharded, the optimizer) is stored: the strategy's."""
        self.async_save = async_save
        self._pending: Write | None = None
        """Rank 0's write of the checkpoint's files."""
        self._shards: Future | None = None
        """This rank's part of DCP's background write of the shards (sharded and async_save)."""
        self._stager: AsyncStager | None = None
        """DCP's stager of those writes (formats.kept_stager), made at the first: its host
        copies are reused by each save after it, which waits for the write before (`finish`)."""
        self.write_seconds: list[float] = []
        """How long each finished write took (rank 0): in the background, training ran meanwhile."""

    # --- save -------------------------------------------------------------------------

    def save(self, step: int, states: dict[str, Stateful], config_yaml: str, keep_also: int | None = None) -> None:
        """Collective: every rank must call it at the same step.

        `keep_also`: a step whose checkpoint pruning keeps beside the newest `keep` (the best
        one). Each rank hands its RNG state to rank 0, rank 0 copies the state to host memory
        and writes it, and all ranks agree on whether the write succeeded: at once, or with
        `async_save` at the next save or `finish()`. A rank never waits alone at a barrier
        that another rank skipped, and if rank 0's disk is full, every rank fails together
        with the same error instead of the others timing out.
        """
        if self.async_save:
            self.finish()  # the previous write, if it is still going: one at a time
        rngs = distributed.gather_to_rank_zero(self.dist_env, ProcessRNG().state_dict())
        tmp = self.store.temporary(step)
        # Every rank may write into it (shards, per-rank states): rank 0 makes it first.
        distributed.rank_zero_does(self.dist_env, f"checkpoint step-{step}: {tmp}", lambda: files.fresh_folder(tmp))
        per_rank = {name: states[name].state_dict() for name in PER_RANK_STATES if name in states}
        if per_rank:
            self._write_per_rank(step, tmp, per_rank)
        self._start_shards(step, tmp, states)
        others = {name: stateful.state_dict() for name, stateful in states.items()
                  if name not in (*self.format.own, TRAIN, *PER_RANK_STATES)}
        if self.dist_env.is_rank_zero:
            self._pending = self._start_write(step, self.format.rank_zero_tensors(states), others,
                                              states[TRAIN].state_dict(), config_yaml, rngs, keep_also, tmp)
        if not self.async_save:
            self.finish()

    def _save_failed(self, step: int, why: str) -> str:
        """The one-line error of a failed save, with the room left on the checkpoints' disk:
        torch.save reports a full disk as "unexpected pos ...", DCP as a rank's OSError."""
        # The nearest folder that exists: the checkpoints' own may not yet, or may be gone.
        existing = next((p for p in (self.root, *self.root.parents) if p.is_dir()), None)
        try:
            room = f" ({shutil.disk_usage(existing).free / 2**20:.1f} MB free in {existing})" if existing else ""
        except OSError:  # a folder removed meanwhile, or unreadable: the reason stands alone
            room = ""
        return f"checkpoint step-{step}: save failed: {why}{room}"

    @contextlib.contextmanager
    def _failing_save(self, tmp: Path) -> Iterator[None]:
        """Around a collective part of a save: a CheckpointError, which every rank raises
        alike, also removes the temporary folder."""
        try:
            yield
        except CheckpointError:
            if self.dist_env.is_rank_zero:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_per_rank(self, step: int, tmp: Path, per_rank: dict) -> None:
        """Collective: each rank's own states into `tmp`/per-rank/rank-N.pt; every rank fails
        with the first rank's error if any rank's write failed."""
        rank = self.dist_env.rank

        def write() -> None:
            try:
                (tmp / PER_RANK).mkdir(exist_ok=True)
                torch.save(per_rank, tmp / PER_RANK / f"rank-{rank}.pt")
            except Exception as e:  # e.g. a full disk: every rank must learn it  # noqa: BLE001
                raise CheckpointError(self._save_failed(step, f"rank {rank}: {describe(e)}")) from None

        with self._failing_save(tmp):
            distributed.every_rank_does(self.dist_env, f"checkpoint step-{step}", write)

    def _start_shards(self, step: int, tmp: Path, states: dict[str, Stateful]) -> None:
        """Collective, in the sharded format: each rank writes its shards (DCP gathers every
        rank's outcome, so a failure is raised on all), or starts writing them in the background."""
        group = None
        if self.async_save and self.format.collective:
            group = distributed.checkpoint_group(self.dist_env)
            self._stager = self._stager or formats.kept_stager(cast(nn.Module, states["model"]))
        with self._failing_save(tmp):
            try:
                self._shards = self.format.start_save(tmp, states, self.async_save, group, self._stager)
            except Exception as e:  # a full disk on any rank: every rank fails with why  # noqa: BLE001
                raise CheckpointError(self._save_failed(step, describe(e))) from None

    def _start_write(self, step: int, tensors: dict, others: dict, state: dict, config_yaml: str, rngs,
                     keep_also: int | None, tmp: Path) -> Write:
        write, shards = Write(step), self._shards
        if self.async_save:
            try:  # training changes the live tensors from the next step on
                tensors, others = host_copy((tensors, others))
            except Exception as e:  # e.g. out of host memory: reported like a failed write  # noqa: BLE001
                return write.failed(e)

        def write_files(folder: Path) -> None:
            if shards is not None:  # complete on every rank first, for the marker to cover them
                formats.SHARDED.wait(shards)
            for name, file_tensors in tensors.items():
                from safetensors.torch import save_model

                # save_model is typed for a Module but calls only .state_dict(): _StateDict says why.
                save_model(_StateDict(file_tensors), str(folder / name))  # type: ignore[arg-type]
            torch.save(others, folder / "optimizer.pt")
            torch.save(rngs, folder / "rng.pt")
            (folder / "state.json").write_text(json.dumps(state, indent=2))
            (folder / "config.yaml").write_text(config_yaml)
            inject.point("checkpoint-files-written", step)

        def write_and_prune() -> None:
            started = time.perf_counter()
            path = self.store.complete(step, tmp, write_files)
            self.store.prune(step, self.keep, keep_also)
            log.info("saved %s in %.2fs%s", path, time.perf_counter() - started,
                     " (in the background)" if self.async_save else "")

        return write.start(write_and_prune, in_background=self.async_save)

    def finish(self) -> None:
        """Collective: wait for rank 0's pending write, then every rank raises its error,
        if any. Called by `save`, and by the loop before the end and before a preemption exit."""
        if self._shards is not None:  # this rank's part of the shards' write
            shards, self._shards = self._shards, None
            with contextlib.suppress(formats.ShardsError):  # any rank's error is rank 0's too, reported below
                formats.SHARDED.wait(shards)
        pending, self._pending = self._pending, None

        def outcome() -> None:
            if pending is None:
                return
            if pending.wait():
                raise CheckpointError(self._save_failed(pending.step, pending.error))
            self.write_seconds.append(pending.seconds)

        distributed.rank_zero_does(self.dist_env, "checkpoint", outcome)

    def close(self) -> None:
        """On any exit: let a background write finish (not collective: peers may be gone).
        A checkpoint that was being written when the job failed is then complete, not lost.
        Shards whose peers are gone fail at the collective timeout (dist.timeout_s)."""
        if self._shards is not None:
            shards, self._shards = self._shards, None
            with contextlib.suppress(formats.ShardsError):  # rank 0's write logs it
                formats.SHARDED.wait(shards)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending.wait():
                log.error("checkpoint step-%d: save failed: %s", pending.step, pending.error)

    # --- load -------------------------------------------------------------------------

    def load_weights(self, step: int, model: nn.Module) -> None:
        """The model's weights from this run's checkpoint at `step` (the best one, say)."""
        load_weights(self.store.folder(step), model)

    def load(self, path: Path, states: dict[str, Stateful], state: dict, seed: int) -> None:
        """Restore `states` (as for save) in place, and this rank's RNG streams, from the
        checkpoint at `path` (of this run's format: the resume plan checked) whose state.json
        is `state` (read once, by the resume plan). The checkpoint is trusted input: the .pt
        files load with weights_only=True, but the sharded format's DCP metadata
        (`sharded/.metadata`) is a pickle, which torch unpickles as it is (docs/security.md)."""
        try:  # first: it verifies the data position, before the weights are read for nothing
            states[TRAIN].load_state_dict(state)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume: {path}: {e}") from None
        try:  # resharded to this run's world size, in the sharded format
            self.format.load(path, states)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume: {e}") from None
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        for name, stateful in states.items():
            # A disabled loss scaler (fp32, bf16) saves an empty state, which an enabled one
            # refuses: it then starts from its default.
            if name not in (*self.format.own, TRAIN, *PER_RANK_STATES) and saved.get(name):
                try:
                    stateful.load_state_dict(saved[name])
                except (ValueError, KeyError, RuntimeError) as e:  # torch's words for a state of another shape
                    raise CheckpointError(f"checkpoint.resume: {path}: its {name} state does not fit this run's "
                                          f"({describe(e)}): written by another version of the trainer or "
                                          "another config; start over with checkpoint.resume=never") from None
        same_world = state["world_size"] == self.dist_env.world_size
        # At another world size no saved rank is this one: each takes rank 0's, and keeps of
        # it what is not one rank's own.
        saved_by = path / PER_RANK / f"rank-{self.dist_env.rank if same_world else 0}.pt"
        for name in PER_RANK_STATES:
            # Absent from a checkpoint of one process, which had no DDP and so no comm hook.
            if name in states and saved_by.is_file():
                states[name].load_state_dict(torch.load(saved_by, weights_only=True)[name])
        if same_world:
            ProcessRNG().load_state_dict(torch.load(path / "rng.pt", weights_only=True)[self.dist_env.rank])
        else:
            ProcessRNG.reseed(seed, state["step"], self.dist_env.rank)

