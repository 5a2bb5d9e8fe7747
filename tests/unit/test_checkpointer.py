"""The Checkpointer on a temp dir, in-process: save, verify, prune, choose, load."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from trainer.checkpoint import formats, resume
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.rng import ProcessRNG
from trainer.checkpoint.store import MARKER, read_state, verify
from trainer.errors import CheckpointError, ConfigError
from trainer.runtime.environment import DistEnv


class Position:
    """A stand-in for the train state: JSON in, JSON out."""

    def __init__(self, step: int = 0, world_size: int = 1):
        self.step, self.world_size, self.loaded = step, world_size, None

    def state_dict(self) -> dict:
        return {"step": self.step, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("poisoned"):
            raise CheckpointError("the data position does not reproduce")
        self.loaded = state


def make_states(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "train": Position()}


def train_one_step(states: dict) -> None:
    states["model"](torch.ones(3, 4)).sum().backward()
    states["optimizer"].step()
    states["scheduler"].step()
    states["optimizer"].zero_grad()
    states["train"].step += 1


def save_steps(ckpt: Checkpointer, states: dict, steps, keep_also=None) -> None:
    for step in steps:
        states["train"].step = step
        ckpt.save(step, states, "seed: 1\n", keep_also=keep_also)


@pytest.fixture
def ckpt(tmp_path) -> Checkpointer:
    return Checkpointer(str(tmp_path), keep=2, dist_env=DistEnv())


def steps_on_disk(ckpt: Checkpointer) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in ckpt.root.glob("step-*"))


@pytest.mark.parametrize("async_save", [False, True])
def test_save_then_load_restores_every_state(tmp_path, async_save):
    ckpt = Checkpointer(str(tmp_path), keep=3, dist_env=DistEnv(), async_save=async_save)
    states = make_states()
    train_one_step(states)
    ckpt.save(1, states, "seed: 1\n")
    ckpt.finish()
    path = ckpt.root / "step-1"
    assert verify(path) is None
    assert sorted(p.name for p in path.iterdir()) == sorted([*formats.WHOLE.required, MARKER])

    fresh = make_states(seed=1)
    assert not torch.equal(fresh["model"].weight, states["model"].weight)
    ckpt.load(path, fresh, read_state(path), seed=0)
    for name in ("weight", "bias"):
        assert torch.equal(getattr(fresh["model"], name), getattr(states["model"], name))
    assert fresh["scheduler"].last_epoch == 1
    assert torch.equal(fresh["optimizer"].state_dict()["state"][0]["exp_avg"],
                       states["optimizer"].state_dict()["state"][0]["exp_avg"])
    assert fresh["train"].loaded == {"step": 1, "world_size": 1}


def test_rng_restored_at_the_same_world_size_and_reseeded_at_another(ckpt):
    states = make_states()
    save_steps(ckpt, states, [3])
    expected = torch.rand(4)  # the stream right after the save
    path = ckpt.root / "step-3"
    torch.manual_seed(1234)
    ckpt.load(path, make_states(), read_state(path), seed=7)
    assert torch.equal(torch.rand(4), expected)

    other_world = {**read_state(path), "world_size": 2}
    ckpt.load(path, make_states(), other_world, seed=7)
    reseeded = torch.rand(4)
    ProcessRNG.reseed(7, 3, 0)
    assert torch.equal(torch.rand(4), reseeded)
    assert not torch.equal(reseeded, expected)


def test_a_train_state_that_refuses_names_the_checkpoint(ckpt):
    states = make_states()
    save_steps(ckpt, states, [2])
    path = ckpt.root / "step-2"
    fresh = make_states(seed=1)
    untouched = fresh["model"].weight.clone()
    with pytest.raises(CheckpointError, match=rf"^checkpoint.resume: {path}: the data position does not reproduce"):
        ckpt.load(path, fresh, {**read_state(path), "poisoned": True}, seed=0)
    assert torch.equal(fresh["model"].weight, untouched)  # refused before the weights are read


def test_prune_keeps_the_newest_and_the_best(ckpt):
    states = make_states()
    save_steps(ckpt, states, [1, 2, 3, 4, 5], keep_also=2)
    assert steps_on_disk(ckpt) == [2, 4, 5]
    save_steps(ckpt, states, [6])  # step 2 is no longer the best: pruned
    assert steps_on_disk(ckpt) == [5, 6]


def test_auto_resume_skips_torn_and_corrupt_checkpoints(ckpt, caplog):
    states = make_states()
    save_steps(ckpt, states, [1, 2])
    assert resume.choose("auto", ckpt.store, DistEnv()) == ckpt.root / "step-2"

    (ckpt.root / "step-2" / "optimizer.pt").write_bytes(b"garbage")
    assert verify(ckpt.root / "step-2") == "optimizer.pt does not match its checksum (truncated or corrupted)"
    assert resume.choose("auto", ckpt.store, DistEnv()) == ckpt.root / "step-1"
    assert "skipping checkpoint" in caplog.text

    (ckpt.root / "step-1" / MARKER).unlink()
    assert verify(ckpt.root / "step-1") == "no completion marker (the save did not finish)"
    assert resume.choose("auto", ckpt.store, DistEnv()) is None
    assert resume.choose("never", ckpt.store, DistEnv()) is None


def test_missing_file_and_unreadable_marker(ckpt):
    save_steps(ckpt, make_states(), [1])
    path = ckpt.root / "step-1"
    (path / "rng.pt").unlink()
    assert verify(path) == "rng.pt is missing"
    (path / MARKER).write_text("{")
    assert verify(path) == "unreadable completion marker"


def test_an_explicit_checkpoint_must_verify(ckpt):
    save_steps(ckpt, make_states(), [1])
    path = ckpt.root / "step-1"
    assert resume.choose(str(path), ckpt.store, DistEnv()) == path
    (path / "state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"checkpoint.resume: .*step-1: state.json does not match its checksum"):
        resume.choose(str(path), ckpt.store, DistEnv())


def test_saving_an_earlier_step_moves_later_timelines_aside(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=3, dist_env=DistEnv())
    states = make_states()
    save_steps(ckpt, states, [1, 2, 3])
    save_steps(ckpt, states, [2])  # a run resumed from step 1 reaches step 2 again
    assert steps_on_disk(ckpt) == [1, 2]
    assert [p.name.split("-")[:3] for p in ckpt.root.glob("abandoned-*")] == [["abandoned", "step", "3"]]
    assert json.loads((ckpt.root / "step-2" / "state.json").read_text())["step"] == 2


def test_a_failed_write_raises_and_keeps_the_previous_checkpoint(ckpt):
    states = make_states()
    save_steps(ckpt, states, [1])

    class Unsaveable(Position):
        def state_dict(self):
            return {"step": 2, "world_size": 1, "not json": object()}

    states["train"] = Unsaveable()
    with pytest.raises(CheckpointError, match=r"checkpoint step-2: save failed: TypeError: .*MB free in"):
        ckpt.save(2, states, "seed: 1\n")
    assert steps_on_disk(ckpt) == [1]
    assert not list(ckpt.root.glob(".tmp-*"))


def test_a_save_whose_folder_is_gone_names_the_room_left_where_it_is_known(tmp_path):
    """A per-rank state (PowerSGD's) written after its checkpoint folder went away (removed
    by another process): the error names the free space of the nearest folder that exists,
    never "nan MB free"."""
    ckpt = Checkpointer(str(tmp_path / "run"), keep=1, dist_env=DistEnv())

    class Vanishing:
        def state_dict(self) -> dict:
            shutil.rmtree(tmp_path / "run")
            return {"error": {}}

        def load_state_dict(self, state: dict) -> None:
            pass

    with pytest.raises(CheckpointError) as raised:
        ckpt.save(1, {**make_states(), "comm_hook": Vanishing()}, "seed: 1\n")
    assert re.fullmatch(rf"checkpoint step-1: save failed: rank 0: FileNotFoundError: .*per-rank' "
                        rf"\([\d.]+ MB free in {re.escape(str(tmp_path))}\)", str(raised.value)), str(raised.value)


def test_background_sharded_saves_stage_through_one_kept_stager(tmp_path, one_rank_group, monkeypatch):
    """FSDP's background saves (DCP) copy the state to host memory through one stager kept for
    the run (formats.kept_stager: page-locked once, on a GPU). The second save overwrites the
    host copies of the first, once its write has finished: each checkpoint still holds its own
    step's weights and AdamW moments."""
    from torch.distributed.fsdp import fully_shard

    made = []
    monkeypatch.setattr(formats, "kept_stager", lambda model, kept=formats.kept_stager: made.append(kept(model))
                        or made[-1])

    def sharded_states(seed: int) -> dict:
        states = make_states(seed)
        fully_shard(states["model"])
        states["optimizer"] = torch.optim.AdamW(states["model"].parameters(), lr=0.1)
        states["scheduler"] = torch.optim.lr_scheduler.LambdaLR(states["optimizer"], lambda step: 1 / (step + 1))
        return states

    def snapshot(states: dict) -> dict:
        moments = states["optimizer"].state_dict()["state"]
        return {**{name: t.full_tensor().clone() for name, t in states["model"].state_dict().items()},
                **{f"{i}.exp_avg": m["exp_avg"].full_tensor().clone() for i, m in moments.items()}}

    ckpt = Checkpointer(str(tmp_path), keep=3, dist_env=one_rank_group, async_save=True,
                        checkpoint_format=formats.SHARDED)
    states, expected = sharded_states(0), {}
    for step in (1, 2):
        train_one_step(states)
        ckpt.save(step, states, "seed: 1\n")
        expected[step] = snapshot(states)
    ckpt.finish()
    assert len(made) == 1  # made at the first save, reused by the second
    assert not all(torch.equal(expected[1][k], expected[2][k]) for k in expected[1])

    for step in (1, 2):
        path = ckpt.root / f"step-{step}"
        assert verify(path) is None
        fresh = sharded_states(seed=1)
        ckpt.load(path, fresh, read_state(path), seed=0)
        loaded = snapshot(fresh)
        assert sorted(loaded) == sorted(expected[step])
        assert all(torch.equal(loaded[k], expected[step][k]) for k in loaded), step
