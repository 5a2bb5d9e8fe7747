"""Checkpoints that are either complete and verified, or ignored.

Layout: `output_dir/checkpoints/step-N/` holding
- model.safetensors   the bare model's weights (no `module.` prefix); under LoRA only the
                      weights that train (trained_tensors)
- optimizer.pt        the optimizer's, the LR schedule's and the fp16 loss scaler's state
                      (loaded with weights_only=True)
- rng.pt              RNG states of every rank (torch, CUDA, Python, NumPy)
- state.json          where the run is (train_state.TrainState): step, epoch, data position and
                      ledger, batch plan, wandb run id, model selection, last validation
- config.yaml         the resolved config of the run
- per-rank/rank-N.pt  with ddp.comm_hook=powersgd: each rank's own PowerSGD state (its error
                      feedback), written by that rank
- COMPLETE            written last: the sha256 of every file above

A run with train.strategy=fsdp writes `sharded/` instead of model.safetensors: the model's and
AdamW's state through torch.distributed.checkpoint (DCP), each rank its own shards and rank 0
the metadata. Its optimizer.pt holds the LR schedule and the loss scaler. DCP reshards on
load, so it too resumes at any world size, and the marker covers every shard.

A checkpoint is written under a temporary name and renamed into place, so a crash or a full
disk mid-save leaves the previous checkpoints untouched. On resume, a folder without a marker,
or whose files don't match the marker's checksums, is skipped with a warning and the previous
one is used. Pruning never removes the checkpoint just written, nor the best one
(checkpoint.best_metric).

A checkpoint resumes on any world size that divides its global batch. At the same world size
every rank gets its own RNG state back (a bitwise resume). At another, ranks can't inherit
states one to one (which of two old ranks' dropout streams would one new rank continue?), so
each rank's RNGs are seeded from (seed, step, rank): deterministic, distinct per rank and
step, and never a replay of the run's first steps.

With `checkpoint.async_save`, training pauses only while the state is copied to host memory;
a background thread on rank 0 writes it (and under FSDP, DCP's async save writes each rank's
shards in a thread of that rank), and every rank learns the write's outcome at the next save
or at the end. A process that exits for any reason finishes its write first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from trainer import distributed, inject, sharded
from trainer.distributed import DistEnv
from trainer.errors import CheckpointError, ConfigError, one_line

if TYPE_CHECKING:  # torch.distributed.checkpoint costs half a second to import
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "config.yaml")
SHARDED = "sharded"
"""The DCP folder of a sharded checkpoint (FSDP): the model's and the optimizer's shards."""
SHARDED_FILES = (f"{SHARDED}/.metadata", "optimizer.pt", "rng.pt", "state.json", "config.yaml")

# A checkpoint saves a dict of `Stateful`s (state_dict and load_state_dict, as DCP takes them):
# the "model" (an nn.Module) as model.safetensors, the "train" state (JSON) as state.json,
# the "comm_hook" state (PowerSGD's, which differs per rank) as per-rank/rank-N.pt written by
# each rank, and every other entry (the optimizer, the LR schedule, the fp16 loss scaler)
# together in optimizer.pt.
_PER_RANK = ("comm_hook",)
PER_RANK = "per-rank"
"""The folder of the states that each rank writes for itself."""
_OWN_FILE = ("model", "train", *_PER_RANK)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def rng_state() -> dict:
    """This process's RNG streams, as tensors and plain lists (safe for weights_only)."""
    # The global legacy generator is MT19937, whose state is this tuple (never the dict form).
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def reseed_rngs(seed: int, step: int, rank: int) -> None:
    """Every RNG stream of this process from (seed, step, rank), for a resume at another
    world size (see the module's docstring)."""
    state = np.random.SeedSequence([seed, step, rank]).generate_state(2)
    torch_seed = int(state[0]) << 32 | int(state[1])
    torch.manual_seed(torch_seed)  # also every CUDA device's generator
    random.seed(torch_seed)
    np.random.seed(state)


def read_state(path: Path) -> dict:
    """A checkpoint's state.json (its step, data position, world size, global batch, ...)."""
    return json.loads((path / "state.json").read_text())


def verify(path: Path) -> str | None:
    """None if `path` is a complete checkpoint whose files match its marker, else why not."""
    marker = path / MARKER
    if not marker.is_file():
        return "no completion marker (the save did not finish)"
    try:
        expected = json.loads(marker.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable completion marker"
    required = SHARDED_FILES if (path / SHARDED).is_dir() else FILES
    for name in sorted(set(required) | set(expected)):  # a sharded one's marker names every shard
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != expected.get(name):
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def host_copy(obj):
    """`obj` (a state dict, nested) with every tensor copied to host memory: the snapshot a
    background write reads while training changes the originals.

    Device tensors go through pinned memory without a sync each (one sync at the end);
    tensors that share storage (tied weights) stay shared, so safetensors still saves them
    once. CPU tensors are cloned: `.to("cpu")` would return the live tensor itself.
    """
    copies: dict[tuple, torch.Tensor] = {}

    def copy(value):
        if isinstance(value, torch.Tensor):
            key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in copies:
                detached = value.detach()
                copies[key] = detached.clone() if detached.device.type == "cpu" else \
                    detached.to("cpu", non_blocking=True)
            return copies[key]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    copied = copy(obj)
    if any(device.type == "cuda" for device, *_ in copies):
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return copied


class _StateDict:
    """A model stand-in for safetensors' save_model, which wants `.state_dict()`: it drops
    the duplicate names of shared tensors and records them in the file's metadata."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


class _Write:
    """One checkpoint write on rank 0, in a background thread or in the caller's."""

    def __init__(self, step: int):
        self.step, self.error, self.seconds = step, "", 0.0
        self._thread: threading.Thread | None = None

    def start(self, write, in_background: bool) -> _Write:
        if in_background:
            # Not a daemon: an exiting interpreter finishes the write rather than tear it.
            self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-step-{self.step}")
            self._thread.start()
        else:
            self._run(write)
        return self

    def _run(self, write) -> None:
        started = time.perf_counter()
        try:
            write()
        except Exception as e:  # any failure must reach the other ranks, or they wait for it  # noqa: BLE001
            self.error = f"{type(e).__name__}: {one_line(e)}"
        self.seconds = time.perf_counter() - started

    def wait(self) -> str:
        """The error, or "" once the write is complete."""
        if self._thread is not None:
            self._thread.join()
        return self.error


def trained_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What model.safetensors holds of `model`: its whole state dict, or where some of its
    parameters are frozen (LoRA's base), the parameters that train alone. The frozen ones
    are model.name's, loaded again from there: a checkpoint of megabytes, not gigabytes."""
    state = model.state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trained}


def _load_model_file(model: nn.Module, file: Path) -> None:
    """`file`'s tensors into `model`, which must expect exactly those (trained_tensors):
    a file of another architecture, or of a run with other model.lora settings, is refused
    by name rather than half loaded."""
    # Straight to the model's device from the mapped file: no full copy in host memory per rank.
    device = next(model.parameters()).device
    missing, unexpected = load_model(model, str(file), strict=False, device=str(device))
    missing = sorted(set(missing) & set(trained_tensors(model)))
    if missing or unexpected:
        names = "; ".join(f"{what} {len(keys)} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})"
                          for what, keys in (("missing", missing), ("unexpected", sorted(unexpected))) if keys)
        raise CheckpointError(f"{file}: not this model's weights (model.name, model.lora): {names}")


def load_weights(path: Path, model: nn.Module) -> None:
    """A verified checkpoint's weights into `model` (the bare one, sharded or not), in place."""
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint: {path}: {problem}")
    if (path / SHARDED).is_dir():
        try:
            sharded.load(path / SHARDED, model)
        except sharded.ShardsError as e:
            raise CheckpointError(f"checkpoint: {path}: {e}") from None
    else:
        _load_model_file(model, path / "model.safetensors")


def _fresh(folder: Path) -> None:
    """`folder`, empty (a leftover of a failed attempt at the same step is removed)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()


class Checkpointer:
    def __init__(self, output_dir: str, keep: int, dist_env: DistEnv, async_save: bool = False,
                 sharded: bool = False):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep
        self.dist_env = dist_env
        self.sharded = sharded
        """The model and optimizer go through DCP, each rank writing its shards (FSDP)."""
        self.async_save = async_save
        self._pending: _Write | None = None
        """Rank 0's write of the checkpoint's files."""
        self._shards: Future | None = None
        """This rank's part of DCP's background write of the shards (sharded and async_save)."""
        self.write_seconds: list[float] = []
        """How long each finished write took (rank 0): in the background, training ran meanwhile."""

    def _step_dirs(self) -> list[Path]:
        """step-N folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
        return sorted(found, key=_step_of, reverse=True)

    # --- save -------------------------------------------------------------------------

    def save(self, step: int, states: dict[str, Stateful], config_yaml: str, keep_also: int | None = None) -> None:
        """Collective: every rank must call it at the same step.

        `states`: what is saved (see `Stateful`). `keep_also`: a step whose checkpoint pruning keeps
        beside the newest `keep` (the best one). Each rank hands its RNG state to rank 0,
        rank 0 copies the state to host memory and writes it, and all ranks agree on whether
        the write succeeded: at once, or with `async_save` at the next save or `finish()`. A
        rank never waits alone at a barrier that another rank skipped, and if rank 0's disk is
        full, every rank fails together with the same error instead of the others timing out.
        """
        if self.async_save:
            self.finish()  # the previous write, if it is still going: one at a time
        rngs = distributed.gather_to_rank_zero(self.dist_env, rng_state())
        model_tensors = None
        own_file: tuple[str, ...] = (*_OWN_FILE, "optimizer") if self.sharded else _OWN_FILE
        per_rank = {name: states[name].state_dict() for name in _PER_RANK if name in states}
        # Where every rank writes files (shards, per-rank states), rank 0 makes the folder first.
        shared_tmp = self.root / f".tmp-step-{step}"
        tmp = shared_tmp if self.sharded or per_rank else None
        if tmp is not None:
            distributed.rank_zero_does(self.dist_env, f"checkpoint step-{step}: {tmp}", lambda: _fresh(shared_tmp))
        if per_rank:
            self._write_per_rank(step, shared_tmp, per_rank)
        if self.sharded:
            group = distributed.checkpoint_group(self.dist_env) if self.async_save else None
            try:  # collective; DCP gathers every rank's outcome, so a failure is raised on all
                self._shards = sharded.save(shared_tmp / SHARDED, cast(nn.Module, states["model"]),
                                            cast(torch.optim.Optimizer, states["optimizer"]), self.async_save, group)
            except Exception as e:  # a full disk on any rank: every rank fails with why  # noqa: BLE001
                if self.dist_env.is_rank_zero:
                    shutil.rmtree(shared_tmp, ignore_errors=True)
                raise CheckpointError(self._save_failed(step, f"{type(e).__name__}: {one_line(e)}")) from None
        trainer_state = {name: stateful.state_dict() for name, stateful in states.items() if name not in own_file}
        if self.dist_env.is_rank_zero:
            if not self.sharded:
                model_tensors = trained_tensors(cast(nn.Module, states["model"]))
            self._pending = self._start_write(step, model_tensors, trainer_state, states["train"].state_dict(),
                                              config_yaml, rngs, keep_also, tmp, self._shards)
        if not self.async_save:
            self.finish()

    def _save_failed(self, step: int, why: str) -> str:
        """The one-line error of a failed save, with the room left on the checkpoints' disk:
        torch.save reports a full disk as "unexpected pos ...", DCP as a rank's OSError."""
        free_mb = shutil.disk_usage(self.root).free / 2**20 if self.root.exists() else float("nan")
        return f"checkpoint step-{step}: save failed: {why} ({free_mb:.1f} MB free in {self.root})"

    def _write_per_rank(self, step: int, tmp: Path, per_rank: dict) -> None:
        """Collective: each rank's own states into `tmp`/per-rank/rank-N.pt; every rank fails
        with the first rank's error if any rank's write failed, leaving no partial folder."""
        error = ""
        try:
            (tmp / PER_RANK).mkdir(exist_ok=True)
            torch.save(per_rank, tmp / PER_RANK / f"rank-{self.dist_env.rank}.pt")
        except Exception as e:  # e.g. a full disk: every rank must learn it  # noqa: BLE001
            error = f"rank {self.dist_env.rank}: {type(e).__name__}: {one_line(e)}"
        failed = [e for e in distributed.all_gather(self.dist_env, error) if e]
        if failed:
            if self.dist_env.is_rank_zero:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._save_failed(step, failed[0]))

    def _start_write(self, step, model_tensors, trainer_state, state, config_yaml, rngs, keep_also,
                     tmp: Path | None, shards: Future | None) -> _Write:
        write = _Write(step)
        if self.async_save:
            try:  # training changes the live tensors from the next step on
                model_tensors, trainer_state = host_copy((model_tensors, trainer_state))
            except Exception as e:  # e.g. out of host memory: reported like a failed write  # noqa: BLE001
                write.error = f"{type(e).__name__}: {one_line(e)}"
                return write

        def write_and_prune() -> None:
            started = time.perf_counter()
            path = self._write(step, model_tensors, trainer_state, state, config_yaml, rngs, tmp, shards)
            self._prune(step, keep_also)
            log.info("saved %s in %.2fs%s", path, time.perf_counter() - started,
                     " (in the background)" if self.async_save else "")

        return write.start(write_and_prune, in_background=self.async_save)

    def finish(self) -> None:
        """Collective: wait for rank 0's pending write, then every rank raises its error,
        if any. Called by `save`, and by the loop before the end and before a preemption exit."""
        error = ""
        if self._shards is not None:  # this rank's part of the shards' write
            shards, self._shards = self._shards, None
            with contextlib.suppress(sharded.ShardsError):  # any rank's error is rank 0's too, reported below
                sharded.wait(shards)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending.wait():
                error = self._save_failed(pending.step, pending.error)
            else:
                self.write_seconds.append(pending.seconds)
        error = distributed.broadcast_from_rank_zero(self.dist_env, error)
        if error:
            raise CheckpointError(error)

    def close(self) -> None:
        """On any exit: let a background write finish (not collective: peers may be gone).
        A checkpoint that was being written when the job failed is then complete, not lost.
        Shards whose peers are gone fail at the collective timeout (dist.timeout_s)."""
        if self._shards is not None:
            shards, self._shards = self._shards, None
            with contextlib.suppress(sharded.ShardsError):  # rank 0's write logs it
                sharded.wait(shards)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending.wait():
                log.error("checkpoint step-%d: save failed: %s", pending.step, pending.error)

    def _write(self, step, model_tensors, trainer_state, state, config_yaml, rngs, tmp: Path | None,
               shards: Future | None) -> Path:
        """The checkpoint's files into `tmp` (which holds the shards, or None: a new folder),
        its marker last, then renamed into place. `shards`: their background write, which
        must be complete on every rank first, for the marker to cover them."""
        final = self.root / f"step-{step}"
        if tmp is None:
            tmp = self.root / f".tmp-step-{step}-{os.getpid()}"
            _fresh(tmp)
        try:
            if shards is not None:
                sharded.wait(shards)
            if model_tensors is not None:
                # save_model is typed for a Module but calls only .state_dict(): _StateDict says why.
                save_model(_StateDict(model_tensors), str(tmp / "model.safetensors"))  # type: ignore[arg-type]
            torch.save(trainer_state, tmp / "optimizer.pt")
            torch.save(rngs, tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
            (tmp / "config.yaml").write_text(config_yaml)
            inject.point("checkpoint-files-written", step)
            checksums = {}
            for file in sorted(f for f in tmp.rglob("*") if f.is_file()):
                _fsync(file)
                checksums[file.relative_to(tmp).as_posix()] = _sha256(file)
            (tmp / MARKER).write_text(json.dumps({"step": step, "sha256": checksums}, indent=2))
            _fsync(tmp / MARKER)
            if final.exists():  # a leftover from an earlier attempt at this step (e.g. corrupt)
                stale = self.root / f".stale-step-{step}-{os.getpid()}"
                final.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _prune(self, step: int, keep_also: int | None) -> None:
        """Keep the checkpoint just written and the newest `keep - 1` complete ones before it,
        and `keep_also`'s.

        Folders from later steps belong to a timeline this run left behind: corrupt ones that
        resume skipped, or ones past a checkpoint the user chose to resume from. Counting them
        could delete the only good checkpoint, and `resume: auto` would pick them up later, so
        they are moved aside (not deleted) where resume doesn't look.
        """
        for later in [p for p in self._step_dirs() if _step_of(p) > step]:
            aside = self.root / f"abandoned-{later.name}-{int(time.time())}"
            later.rename(aside)
            log.warning("moved %s aside to %s: this run resumed from an earlier step", later, aside.name)
        complete = [p for p in self._step_dirs() if (p / MARKER).is_file()]
        for old in complete[self.keep :]:
            if _step_of(old) != keep_also:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    # --- resume -----------------------------------------------------------------------

    def find_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from, chosen by rank 0 and the same on every rank."""
        choice = distributed.rank_zero_does(self.dist_env, f"checkpoint.resume: {self.root}",
                                            lambda: self._choose(resume))
        choice = distributed.broadcast_from_rank_zero(self.dist_env, choice)
        return None if choice is None else Path(choice)

    def _choose(self, resume: str) -> str | None:
        if resume == "never":
            return None
        if resume != "auto":
            problem = verify(Path(resume))
            if problem:
                raise ConfigError(f"checkpoint.resume: {resume}: {problem}")
            return resume
        for path in self._step_dirs():
            problem = verify(path)
            if problem is None:
                return str(path)
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def load_weights(self, step: int, model: nn.Module) -> None:
        """The model's weights from this run's checkpoint at `step` (the best one, say)."""
        load_weights(self.root / f"step-{step}", model)

    def load(self, path: Path, states: dict[str, Stateful], state: dict, seed: int) -> None:
        """Restore `states` (as for save) in place, and this rank's RNG streams, from the
        checkpoint at `path` whose state.json is `state` (read once, by the resume plan).
        Nothing is unpickled."""
        if self.sharded != (path / SHARDED).is_dir():  # even when checkpoint.allow_changes lists train.strategy
            written, this = ("fsdp (sharded)", "ddp") if (path / SHARDED).is_dir() else ("ddp", "fsdp (sharded)")
            raise CheckpointError(f"checkpoint.resume: {path}: written by train.strategy={written}, and this run "
                                  f"is {this}: the two formats don't convert; resume it with the strategy that "
                                  "wrote it, or start a new output_dir")
        try:  # first: it verifies the data position, before the weights are read for nothing
            states["train"].load_state_dict(state)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume: {path}: {e}") from None
        if (path / SHARDED).is_dir():  # resharded to this run's world size
            try:
                sharded.load(path / SHARDED, cast(nn.Module, states["model"]),
                             cast(torch.optim.Optimizer, states["optimizer"]))
            except sharded.ShardsError as e:
                raise CheckpointError(f"checkpoint.resume: {path}: {e}") from None
        else:
            _load_model_file(cast(nn.Module, states["model"]), path / "model.safetensors")  # the bare model
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        for name, stateful in states.items():
            # A disabled loss scaler (fp32, bf16) saves an empty state, which an enabled one
            # refuses: it then starts from its default.
            if name not in _OWN_FILE and saved.get(name):
                stateful.load_state_dict(saved[name])
        same_world = state["world_size"] == self.dist_env.world_size
        # At another world size no saved rank is this one: each takes rank 0's, and keeps of
        # it what is not one rank's own.
        saved_by = path / PER_RANK / f"rank-{self.dist_env.rank if same_world else 0}.pt"
        for name in _PER_RANK:
            # Absent from a checkpoint of one process, which had no DDP and so no comm hook.
            if name in states and saved_by.is_file():
                states[name].load_state_dict(torch.load(saved_by, weights_only=True)[name])
        if same_world:
            set_rng_state(torch.load(path / "rng.pt", weights_only=True)[self.dist_env.rank])
        else:
            reseed_rngs(seed, state["step"], self.dist_env.rank)
