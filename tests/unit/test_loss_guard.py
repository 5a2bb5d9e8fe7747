"""Steps that go wrong without failing (trainer/faults/numerics.py): a try whose loss or
gradients are not finite is skipped, leaving the model, the optimizer and the LR schedule as
they were; the loss scaler keeps its own rule for fp16's overflowing gradients; spikes are
measured against the recent median; bad tries in a row roll back once per step, then stop."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from support.runs import tiny_overrides

from trainer.cli import run_config
from trainer.data import labels
from trainer.exit_codes import Exit
from trainer.faults import inject
from trainer.faults.numerics import (
    SPIKE_MIN_STEPS,
    BadSteps,
    LossGuard,
    NonFiniteTraining,
    NonFiniteWeights,
    Outcome,
    check_weights,
)
from trainer.runtime.environment import DistEnv
from trainer.train import build
from trainer.train.step import StepObserver


def guard(**fault) -> LossGuard:
    settings = {"max_bad_steps": 3, "spike_factor": 10.0, "rollback_on_spike": False, **fault}
    return LossGuard(OmegaConf.create(settings), DistEnv())


def judge(g: LossGuard, loss: float, norm: float | None = 1.0, fp16: bool = False) -> Outcome:
    return g.judge(torch.tensor(loss), None if norm is None else torch.tensor(norm), scaler_skips_overflow=fp16)


@pytest.fixture
def built(tiny_model, reviews, tmp_path):
    cfg = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"train.batch_size": 4}))
    yield build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=4)
    inject.configure(DistEnv(), {})


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 3])}


def test_a_nan_try_changes_nothing_and_the_next_try_trains(built):
    step = built.step
    inject.configure(DistEnv(), {"TRAINER_FAULT_NAN": "0:1"})
    inject.into_step(step)  # as the Trainer does
    before = {name: p.detach().clone() for name, p in built.model.named_parameters()}
    step_observer = _Observer()
    skipped = step.settled([batch()], 1, step_observer)
    assert not skipped.taken and skipped.bad == "non-finite loss" and step_observer.calls == ["skipped"]
    assert all(torch.equal(before[name], p) for name, p in built.model.named_parameters())
    # No AdamW step (the fused AdamW skipped it on the device: its state is a fresh one's), no LR step.
    assert all(state["step"] == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
               for state in step.optimizer.state.values()) and step.scheduler.last_epoch == 0
    assert all(p.grad is None for p in built.model.parameters())
    taken = step.settled([batch()], 1, step_observer)  # the fault fired on the first try only
    assert taken.taken and taken.bad is None and step_observer.calls == ["skipped", "done"]
    assert step.scheduler.last_epoch == 1
    assert not all(torch.equal(before[name], p) for name, p in built.model.named_parameters())


class _Observer(StepObserver):
    def __init__(self):
        self.calls: list[str] = []

    def micro_batch(self, lengths):
        pass

    def phase(self, name, at=None):
        pass

    def step_done(self, loss, grad_norm):
        self.calls.append("done")

    def step_skipped(self):
        self.calls.append("skipped")


def test_a_loss_or_gradient_norm_that_is_not_finite_is_bad_and_fp16_overflow_is_the_scalers():
    g = guard()
    assert judge(g, float("nan")).bad == "non-finite loss"
    assert judge(g, float("inf")).bad == "non-finite loss"
    assert judge(g, 0.5, float("inf")).bad == "non-finite gradient norm"
    assert judge(g, 0.5, float("nan")).bad == "non-finite gradient norm"
    # fp16: the scaler skips the overflowing step itself and halves its scale; a NaN loss stays bad.
    assert judge(g, 0.5, float("inf"), fp16=True) == Outcome(True, 0.5, float("inf"))
    assert judge(g, float("nan"), float("inf"), fp16=True).bad == "non-finite loss"
    assert judge(g, 0.5) == Outcome(True, 0.5, 1.0)
    # fault.max_bad_steps=0 and no spike check: nothing is checked, nothing is synchronized.
    off = guard(max_bad_steps=0, spike_factor=0)
    assert not off.enabled and judge(off, float("nan")) == Outcome(True, None, None)
    # The check off but spikes on: a NaN is trained on, as before the check.
    assert judge(guard(max_bad_steps=0), float("nan")).taken


def test_a_spike_is_measured_against_the_recent_median_and_rolls_back_only_when_asked():
    logged, skipping = guard(), guard(rollback_on_spike=True)
    for g in (logged, skipping):
        for _ in range(SPIKE_MIN_STEPS - 1):
            assert judge(g, 1.0).spike is None
    assert judge(logged, 100.0).spike is None  # too few steps yet to call anything a spike
    assert judge(skipping, 1.0).spike is None
    assert judge(logged, 16.0) == Outcome(True, 16.0, 1.0, None, 16.0)  # median 1: 16x, logged, trained on
    assert judge(skipping, 16.0) == Outcome(False, 16.0, 1.0, "loss spike", 16.0)
    assert judge(skipping, 9.0).spike is None  # under 10x


def test_bad_tries_in_a_row_roll_back_once_per_step_then_stop_with_77():
    bad, steps = Outcome(False, float("nan"), None, "non-finite loss"), BadSteps(max_bad_steps=2)
    assert not steps.observe(3, bad, "batch 2")  # 1 of 2
    assert not steps.observe(5, bad, "batch 5")  # another step: a new streak
    assert steps.observe(5, bad, "batch 6")  # 2 of 2: roll back
    assert not steps.observe(5, bad, "batch 9")
    with pytest.raises(NonFiniteTraining) as stopped:
        steps.observe(5, bad, "batch 10")
    assert stopped.value.exit_code == Exit.NO_PROGRESS
    assert str(stopped.value).startswith("step 5 failed 2 tries in a row again after a rollback (non-finite loss, "
                                         "the last on batch 10)")
    spike = Outcome(True, 12.0, None, None, 12.0)
    assert not steps.observe(8, spike, "batch 14")
    assert steps.summary() == {"skipped_steps": 5, "rollbacks": 1, "loss_spikes": 1}
    resumed = BadSteps(max_bad_steps=2)
    resumed.load_state_dict(steps.state_dict())
    assert resumed.summary() == steps.summary() and resumed.rolled_back_for == [5]


def test_weights_that_are_not_finite_are_named_before_any_save():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    check_weights(model, DistEnv())
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    with pytest.raises(NonFiniteWeights, match=r"the weights are not finite \(1.bias\): not saved"):
        check_weights(model, DistEnv())
