"""The resume plan, in-process: which checkpoint, which config changes, which global batch."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from omegaconf import OmegaConf

from trainer.checkpoint import resume
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.cli import run_config
from trainer.config import loading, schema
from trainer.errors import CheckpointError, ConfigError
from trainer.runtime.environment import DistEnv
from trainer.strategies import registry


def load(tmp_path, *overrides: str):
    return run_config.load(None, ["model.name=org/model", "data.path=org/data", "data.num_labels=2",
                              f"output_dir={tmp_path}", "train.max_steps=10", *overrides])


class SavedPosition:
    def __init__(self, step: int, global_batch: int, world_size: int = 2):
        self.saved = {"step": step, "epoch": 0, "world_size": world_size, "global_batch": global_batch}

    def state_dict(self) -> dict:
        return self.saved

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("the plan loads nothing")


def checkpointer(cfg, env: DistEnv) -> Checkpointer:
    """The run's checkpointer, in its strategy's format, as the Trainer makes it."""
    return Checkpointer(cfg.output_dir, cfg.checkpoint.keep, env, checkpoint_format=registry.of(cfg).checkpoint_format)


def checkpointed(tmp_path, *overrides: str, step: int = 4, global_batch: int = 32):
    """A run's checkpoint at `step`, written with the config these overrides give."""
    cfg = load(tmp_path, *overrides)
    model = torch.nn.Linear(2, 2)
    states = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
              "train": SavedPosition(step, global_batch)}
    checkpointer(cfg, DistEnv()).save(step, states, loading.to_yaml(cfg))
    return tmp_path / "checkpoints" / f"step-{step}"


def plan(tmp_path, *overrides: str, world_size: int = 1) -> resume.ResumePlan:
    cfg = load(tmp_path, *overrides)
    env = DistEnv(world_size=world_size)
    return resume.decide(cfg, env, checkpointer(cfg, env))


def test_a_fresh_run_plans_from_its_config(tmp_path):
    fresh = plan(tmp_path, "train.batch_size=8", "train.grad_accum=2", world_size=2)
    assert (fresh.path, fresh.saved, fresh.step, fresh.accepted_changes) == (None, None, 0, [])
    assert (fresh.batch.global_batch, fresh.batch.micro_batch, fresh.batch.grad_accum) == (32, 8, 2)


def test_a_resume_keeps_the_checkpoints_global_batch_at_any_world_size(tmp_path, caplog):
    path = checkpointed(tmp_path, global_batch=32)
    resumed = plan(tmp_path, "train.batch_size=8", world_size=2)
    assert (resumed.path, resumed.step) == (path, 4)
    assert (resumed.batch.global_batch, resumed.batch.micro_batch, resumed.batch.grad_accum) == (32, 8, 2)
    assert "the global batch stays the checkpoint's, 32, not train.batch_size x train.grad_accum x world size = 16" \
        in caplog.text
    with pytest.raises(ConfigError, match=r"train.global_batch: 32 \(the resumed checkpoint's\) samples per step "
                                          r"cannot be split evenly over world size 3"):
        plan(tmp_path, world_size=3)


def test_free_keys_change_silently(tmp_path):
    checkpointed(tmp_path)
    resumed = plan(tmp_path, "train.log_every=3", "wandb.mode=disabled", "ddp.bucket_cap_mb=5", "train.batch_size=4")
    assert resumed.accepted_changes == []


def test_a_fixed_key_is_refused_in_one_line_naming_old_and_new(tmp_path):
    path = checkpointed(tmp_path)
    with pytest.raises(ConfigError) as refused:
        plan(tmp_path, "train.lr=0.001", "seed=7")
    assert str(refused.value) == (
        f"checkpoint.resume: {path} was written with another config: seed: 42 -> 7; train.lr: 2e-05 -> 0.001. "
        "Resume with the checkpoint's values, accept a change with checkpoint.allow_changes=[KEY,...], or start "
        "over with checkpoint.resume=never")


@pytest.mark.parametrize("saved, given, change", [
    ("model.lora.r=8", "model.lora.r=16", "model.lora.r: 8 -> 16"),
    ("model.lora.r=null", "model.lora.r=8", "model.lora.r: None -> 8"),  # LoRA onto full fine-tuning's state
    ("model.lora.r=8", "model.lora.r=null", "model.lora.r: 8 -> None"),
    ("model.lora.r=8", "model.lora.target_modules=[query,key,value]", "model.lora.target_modules: None -> "),
    ("model.lora.r=8", "model.name=org/other", "model.name: org/model -> org/other"),  # another base, by name
], ids=["rank", "lora-on", "lora-off", "target-modules", "base"])
def test_lora_settings_and_the_base_are_refused_on_resume(tmp_path, saved, given, change):
    checkpointed(tmp_path, saved)
    with pytest.raises(ConfigError, match=re.escape(change)):
        plan(tmp_path, saved, given)


@pytest.mark.parametrize("saved, given, change", [
    ("ddp.comm_hook=none", "ddp.comm_hook=bf16", "ddp.comm_hook: none -> bf16"),
    ("ddp.comm_hook=powersgd", "ddp.powersgd_rank=8", "ddp.powersgd_rank: 4 -> 8"),
], ids=["hook", "powersgd-rank"])
def test_a_change_of_gradient_compression_is_refused_on_resume(tmp_path, saved, given, change):
    """A compressed run is not an uncompressed one, nor one compressed otherwise."""
    checkpointed(tmp_path, saved)
    with pytest.raises(ConfigError, match=re.escape(change)):
        plan(tmp_path, saved, given)


@pytest.mark.parametrize("saved_by, resumed_by", [("ddp", "fsdp"), ("fsdp", "ddp"), ("fsdp", "dp")])
def test_a_checkpoint_of_the_other_format_is_refused_before_anything_loads(tmp_path, saved_by, resumed_by):
    """DDP's files and FSDP's shards don't convert: refused by the plan, in seconds, even when
    checkpoint.allow_changes names train.strategy (tests/e2e/test_fsdp.py: under torchrun)."""
    path = checkpointed(tmp_path, f"train.strategy={saved_by}")
    written, this = (f"{name} (sharded)" if name == "fsdp" else name for name in (saved_by, resumed_by))
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint.resume: {path}: written by train.strategy={written}, and this run is {this}: the two "
            "formats don't convert")):
        plan(tmp_path, f"train.strategy={resumed_by}", "checkpoint.allow_changes=[train.strategy]")
    assert plan(tmp_path, f"train.strategy={saved_by}").path == path


@pytest.mark.parametrize("saved, given, change", [
    ("data.eval_fraction=0.1", "data.eval_fraction=0.2", "data.eval_fraction: 0.1 -> 0.2"),
    ("data.label_names=[a,b]", "data.label_names=[b,a]", "data.label_names: ['a', 'b'] -> ['b', 'a']"),
    ("train.class_weights=balanced", "train.class_weights=null", "train.class_weights: balanced -> None"),
    ("data.problem_type=single_label", "data.problem_type=multi_label",
     "data.problem_type: single_label -> multi_label"),
], ids=["eval-fraction", "label-names", "class-weights", "problem-type"])
def test_a_change_of_the_held_out_share_or_the_labels_is_refused_on_resume(tmp_path, saved, given, change):
    """Another validation split, or other ids for the same names, is another run."""
    checkpointed(tmp_path, saved)
    with pytest.raises(ConfigError, match=re.escape(change)):
        plan(tmp_path, saved, given)


def test_allow_changes_accepts_a_key_or_a_section(tmp_path):
    checkpointed(tmp_path)
    accepted = plan(tmp_path, "train.lr=0.001", "data.max_length=64", "checkpoint.allow_changes=[train.lr,data]")
    assert list(map(str, accepted.accepted_changes)) == ["data.max_length: 128 -> 64", "train.lr: 2e-05 -> 0.001"]


def test_a_run_may_grow_but_not_shrink_without_allow_changes(tmp_path):
    checkpointed(tmp_path)
    assert plan(tmp_path, "train.max_steps=20").accepted_changes == [("train.max_steps", 10, 20)]
    with pytest.raises(ConfigError, match=re.escape("train.max_steps: 10 -> 5")):
        plan(tmp_path, "train.max_steps=5")


def test_the_global_batch_is_refused_even_when_allowed(tmp_path):
    checkpointed(tmp_path, "train.global_batch=32", global_batch=32)
    with pytest.raises(ConfigError, match=r"train.global_batch: 32 -> 16 \(the data position is counted in global "
                                          r"batches: a run keeps its own\)"):
        plan(tmp_path, "train.global_batch=16", "checkpoint.allow_changes=[train.global_batch]")


def test_keys_an_older_schema_lacked_are_not_changes(tmp_path):
    saved = OmegaConf.create({"train": {"lr": 2e-5}})
    assert resume.config_changes(saved, load(tmp_path, "train.lr=2e-5")) == ([], [])


def test_every_key_says_what_a_resume_may_do_with_it():
    assert schema.RESUME_RULES  # the schema's every leaf
    assert set(schema.RESUME_RULES.values()) == {schema.FREE, schema.EXTEND, schema.FIXED}
    assert {k for k, rule in schema.RESUME_RULES.items() if rule == schema.EXTEND} == {"train.max_steps",
                                                                                       "train.epochs"}
    with pytest.raises(TypeError, match="resume must be FREE, EXTEND or FIXED"):
        @dataclasses.dataclass
        class Undecided:
            new_key: int = schema.key(1)
