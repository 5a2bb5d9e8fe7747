"""trainer/train/build.py, the one way to build a run: doctor's forecast times the very step that
training runs, so that what changes in the step (the comm hook, the gradient sync of
accumulation, clipping) changes both, with nothing to mirror in trainer/preflight/forecast.py."""

from __future__ import annotations

import pytest
import torch
from support.runs import tiny_overrides

from trainer.cli.run_config import load as load_config
from trainer.data import labels, loaders, reading
from trainer.data.batch_plan import BatchPlan
from trainer.preflight import forecast
from trainer.runtime.environment import DistEnv
from trainer.train import build
from trainer.train.step import StepObserver, TrainStep


@pytest.fixture
def run_config(tiny_model, reviews, tmp_path):
    def make(**extra):
        return load_config(None, tiny_overrides(tiny_model, reviews, tmp_path / "run", **{
            "train.batch_size": 4, "data.num_workers": 0, **extra}))

    return make


def test_the_forecast_times_the_step_that_training_runs(run_config, one_rank_group, monkeypatch):
    """The forecast's timed calls are TrainStep's, on the step build() returns, and a change of
    the comm hook reaches the forecast's step and training's alike."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ran: list[tuple[TrainStep, int]] = []
    real_call = TrainStep.__call__
    monkeypatch.setattr(TrainStep, "__call__", lambda self, batches, step, observer: (
        ran.append((self, len(batches))), real_call(self, batches, step, observer))[1])
    compressed = []
    bf16_hook = default_hooks.bf16_compress_hook
    monkeypatch.setattr(default_hooks, "bf16_compress_hook",
                        lambda state, bucket: (compressed.append(bucket.index()), bf16_hook(state, bucket))[1])
    cfg = run_config(**{"ddp.comm_hook": "bf16", "ddp.sparse_embedding_grad": False})
    cpu = torch.device("cpu")

    measured = forecast.measure(cfg, one_rank_group, cpu)
    assert ran and {step for step, _ in ran} == {measured.built.step}
    assert len(ran) == 6 and all(micro_batches == 1 for _, micro_batches in ran)  # 2 to warm up, 4 timed
    assert compressed, "the forecast's DDP all-reduced through ddp.comm_hook's hook"
    assert min(measured.compute.forward_s, measured.compute.backward_s, measured.compute.optimizer_s) > 0

    ran.clear()
    compressed.clear()
    training = build.build(cfg, one_rank_group, cpu, labels.from_config(cfg.data), max_steps=4)
    ids = torch.randint(5, 100, (4, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(4, dtype=torch.long)}
    training.step([batch, batch], 1, StepObserver())  # accumulating two micro-batches
    assert [micro_batches for _, micro_batches in ran] == [2] and compressed
    assert type(training.step) is type(measured.built.step)
    assert type(training.strategy) is type(measured.built.strategy)


def test_evaluate_loads_a_checkpoint_into_the_architecture_training_builds(run_config, tmp_path):
    """A checkpoint's weights go into model.name's model, LoRA applied, as build() makes it."""
    from trainer.checkpoint.checkpointer import Checkpointer

    cfg = run_config(**{"model.lora.r": 4})
    built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=1)

    class Position:
        def state_dict(self):
            return {"step": 1, "world_size": 1}

    with torch.no_grad():
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)  # as training would move them from their zero start
    Checkpointer(str(tmp_path / "run"), keep=1, dist_env=DistEnv()).save(1, built.states(Position()), "seed: 1\n")
    loaded = build.trained(cfg, DistEnv(), torch.device("cpu"), tmp_path / "run" / "checkpoints" / "step-1")
    assert not loaded.model.training and loaded.task.labels == labels.from_config(cfg.data)
    trained = {n: p for n, p in built.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, dict(loaded.model.named_parameters())[n]) for n, p in trained.items())
    ids = torch.randint(5, 100, (2, 8))
    built.model.eval()
    assert torch.equal(loaded.logits(input_ids=ids), built.model(input_ids=ids).logits)


def test_doctor_times_the_runs_own_save(run_config, tmp_path, monkeypatch):
    """grace.time_save times the Checkpointer a run saves with, in its strategy's format, with
    every state of the run (a LoRA run saves what trains alone); the scratch folder goes after."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.preflight import grace

    cfg = run_config(**{"model.lora.r": 4})
    env, cpu = DistEnv(), torch.device("cpu")
    built = build.build(cfg, env, cpu, labels.from_config(cfg.data), max_steps=1)
    run_data = loaders.build(cfg, env, reading.load(cfg, env), built.tokenizer, cpu, BatchPlan.of(cfg.train, 1))
    saved = []
    real_save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda self, step, states, config_yaml, keep_also=None: (
        saved.append((self.format, sorted(states), self.root)),
        real_save(self, step, states, config_yaml, keep_also))[1])
    folder = tmp_path / ".doctor-save"
    seconds = grace.time_save(cfg, env, built, run_data, folder)
    assert seconds > 0 and not folder.exists()
    assert saved == [(built.strategy.checkpoint_format, ["model", "optimizer", "scaler", "scheduler", "train"],
                      folder / "checkpoints")]


def test_doctor_saves_each_rank_s_own_state(run_config, one_rank_group, tmp_path, monkeypatch):
    """PowerSGD's error feedback is each rank's own: doctor's save check writes it, as
    training does, to per-rank/rank-N.pt of the checkpoint in doctor's scratch folder, one
    folder for every rank (tests/e2e/test_doctor_saves.py: two ranks), removed after."""
    import shutil

    from trainer.preflight import doctor, grace

    cfg = run_config(**{"ddp.comm_hook": "powersgd"})
    measured = forecast.measure(cfg, one_rank_group, torch.device("cpu"))
    folder = doctor.save_folder(tmp_path / "run", one_rank_group)
    checkpoint, written, own = folder / "checkpoints" / "step-0", [], []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if path == folder:  # the save check's cleanup: what it saved, first
            written.extend(str(f.relative_to(checkpoint)) for f in sorted(checkpoint.rglob("*")) if f.is_file())
            own.append(torch.load(checkpoint / "per-rank" / "rank-0.pt", weights_only=True))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert grace.time_save(cfg, one_rank_group, measured.built, measured.data, folder) > 0
    assert {"per-rank/rank-0.pt", "COMPLETE"} <= set(written)
    assert own[0]["comm_hook"]["error"]  # the timed steps compressed, leaving error feedback
    assert folder.parent == (tmp_path / "run").resolve() and not folder.exists()


def test_every_part_of_the_training_step_runs_inside_a_phase(run_config):
    """The step reports a phase before each part of its work: what the Meter times (with a
    fake clock, tests/unit/test_meter.py) is then the whole step, whatever the machine's load."""
    cfg = run_config()
    built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=2)
    calls: list[str] = []

    class Recorder(StepObserver):
        def micro_batch(self, lengths):
            calls.append("micro_batch")

        def phase(self, name, at=None):
            calls.append(f"phase:{name}")

        def step_done(self, loss, grad_norm):
            calls.append("step_done")

    ids = torch.randint(5, 100, (4, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(4, dtype=torch.long)}
    built.step([batch, batch], 1, Recorder())
    per_micro_batch = ["micro_batch", "phase:forward", "phase:backward"]
    # The step's time ends with it; its verdict comes when the host reads it (trainer/train/step.py).
    assert calls == [*per_micro_batch, *per_micro_batch, "phase:optimizer", "phase:None"]
    assert built.step.settle().taken and calls[-1] == "step_done"
