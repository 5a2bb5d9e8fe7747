"""Fault injection: which TRAINER_FAULT_* variable fires where, on which rank and attempt.
The faults' signals are recorded, not sent."""

from __future__ import annotations

import os
import signal
from contextlib import nullcontext

import pytest
import torch

from trainer.faults import inject
from trainer.runtime.environment import DistEnv

RANK_1 = DistEnv(rank=1, world_size=2, master_addr="localhost", master_port=29500)
POINTS = ["step", "gradients", "weights", "checkpoint-files-written", "phase:step", "phase:eval", "phase:save"]


@pytest.fixture(autouse=True)
def signals(monkeypatch) -> list[signal.Signals]:
    sent: list[signal.Signals] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(signal.Signals(sig)) if pid == os.getpid() else None)
    yield sent
    inject.configure(DistEnv(), {})  # disarmed for whatever runs next in this process


def model_with_gradients() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model(torch.ones(1, 3)).sum().backward()
    return model


def run_points(steps=range(12)) -> list[tuple[str, int]]:
    """Every point at every step; where an InjectedFault was raised."""
    raised = []
    for step in steps:
        for name in POINTS:
            try:
                inject.point(name, step, model=model_with_gradients())
            except inject.InjectedFault:
                raised.append((name, step))
    return raised


def test_nothing_fires_when_no_variable_is_set(signals):
    inject.configure(RANK_1, {"PATH": "/bin", "TRAINER_FAULT_SIGKILL": ""})
    assert run_points() == [] and signals == []
    assert inject._armed == {}  # so a point costs one dict lookup


@pytest.mark.parametrize("spec, fires", [("1:3", True), ("*:3", True), ("0:3", False)])
def test_sigkill_at_a_step_on_this_rank_or_every_rank(signals, spec, fires):
    inject.configure(RANK_1, {"TRAINER_FAULT_SIGKILL": spec})
    inject.point("step", 2)
    inject.point("gradients", 3, model=model_with_gradients())
    assert signals == []
    inject.point("step", 3)
    assert signals == ([signal.SIGKILL] if fires else [])


@pytest.mark.parametrize("spec, restart_count, fires", [
    ("1:3", 0, True), ("1:3", 1, False),  # no @N: the first attempt only
    ("1@1:3", 0, False), ("1@1:3", 1, True), ("*@2:3", 2, True), ("0@1:3", 1, False),
])
def test_rank_at_n_fires_only_in_torchruns_restart_n(signals, spec, restart_count, fires):
    env = DistEnv(rank=1, world_size=2, master_addr="localhost", master_port=29500, restart_count=restart_count)
    inject.configure(env, {"TRAINER_FAULT_SIGKILL": spec})
    run_points()
    assert signals == ([signal.SIGKILL] if fires else [])


@pytest.mark.parametrize("spec, fires", [("1:4", True), ("*:4", True), ("0:4", False)])
def test_raise_as_the_step_begins(signals, spec, fires):
    inject.configure(RANK_1, {"TRAINER_FAULT_RAISE": spec})
    assert run_points() == ([("step", 4)] if fires else [])
    expected = pytest.raises(inject.InjectedFault, match=r"^TRAINER_FAULT_RAISE: injected at step 4$")
    with expected if fires else nullcontext():
        inject.point("step", 4)
    assert signals == []


def test_sigkill_comes_before_raise_at_the_same_step(signals):
    inject.configure(RANK_1, {"TRAINER_FAULT_SIGKILL": "1:5", "TRAINER_FAULT_RAISE": "*:5"})
    with pytest.raises(inject.InjectedFault):
        inject.point("step", 5)
    assert signals == [signal.SIGKILL]  # recorded here; a real SIGKILL never returns


@pytest.mark.parametrize("spec, fires", [("1:3", True), ("*:3", True), ("0:3", False)])
def test_overflow_puts_an_inf_in_the_last_gradient_at_its_step(signals, spec, fires):
    inject.configure(RANK_1, {"TRAINER_FAULT_OVERFLOW": spec})
    model = model_with_gradients()
    inject.point("gradients", 2, model=model)
    inject.point("step", 3, model=model)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    inject.point("gradients", 3, model=model)
    last = list(model.parameters())[-1].grad
    assert torch.isinf(last.view(-1)[0]).item() is fires
    assert all(torch.isfinite(p.grad).all() for p in list(model.parameters())[:-1])
    assert signals == []


@pytest.mark.parametrize("spec, fires", [("1:eval:20", True), ("*:eval:20", True), ("0:eval:20", False)])
def test_sigstop_as_the_phase_of_the_step_begins(signals, spec, fires):
    inject.configure(RANK_1, {"TRAINER_FAULT_SIGSTOP": spec})
    for name, step in [("phase:eval", 19), ("phase:save", 20), ("phase:step", 20), ("step", 20)]:
        inject.point(name, step)
    assert signals == []
    inject.point("phase:eval", 20)
    assert signals == ([signal.SIGSTOP] if fires else [])


@pytest.mark.parametrize("restart_count", [0, 1])
@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_in_save_has_no_rank_and_fires_in_every_attempt(signals, rank, restart_count):
    env = DistEnv(rank=rank, world_size=2, master_addr="localhost", master_port=29500, restart_count=restart_count)
    inject.configure(env, {"TRAINER_FAULT_SIGKILL_IN_SAVE": "6"})
    for step in (5, 7):
        inject.point("checkpoint-files-written", step)
    inject.point("step", 6)
    assert signals == []
    inject.point("checkpoint-files-written", 6)
    assert signals == [signal.SIGKILL]


def test_configure_again_disarms(signals):
    inject.configure(RANK_1, {"TRAINER_FAULT_SIGKILL": "*:3"})
    inject.configure(RANK_1, {})
    run_points()
    assert signals == []


@pytest.mark.parametrize("variable, spec", [("TRAINER_FAULT_SIGKILL", "1:three"),
                                            ("TRAINER_FAULT_SIGKILL", "1@x:3"),
                                            ("TRAINER_FAULT_SIGKILL_IN_SAVE", "six")])
def test_a_malformed_spec_fails_at_startup(variable, spec):
    with pytest.raises(ValueError):
        inject.configure(RANK_1, {variable: spec})


def test_nan_losses_at_several_steps_each_for_its_first_tries():
    inject.configure(RANK_1, {"TRAINER_FAULT_NAN": "1:3,1:7:2,0:5"})
    poisoned = []
    for step in (3, 3, 5, 7, 7, 7):
        model = torch.nn.Linear(2, 1)
        loss = model(torch.ones(2)).sum()
        loss.backward()
        step_loss = loss.detach()
        inject.point("loss", step, loss=step_loss, model=model)  # as the step calls it, after backward
        poisoned.append((step, bool(step_loss.isnan()), all(bool(p.grad.isnan().all()) for p in model.parameters())))
    assert poisoned == [(3, True, True), (3, False, False), (5, False, False), (7, True, True), (7, True, True),
                        (7, False, False)]


class Step:
    """A stand-in for the training step's part that `into_step` wraps."""

    def __init__(self):
        self.model, self.ready = model_with_gradients(), []

    def gradients_ready(self, step: int, step_loss: torch.Tensor) -> None:
        self.ready.append(step)


def test_a_step_with_no_fault_armed_in_it_is_not_wrapped():
    inject.configure(RANK_1, {"TRAINER_FAULT_SIGKILL": "1:3"})  # armed between steps, not in one
    step = Step()
    inject.into_step(step)
    assert "gradients_ready" not in vars(step)  # the class's own method: nothing added to the step
    step.gradients_ready(3, torch.tensor(1.0))
    assert step.ready == [3]


def test_a_fault_in_the_step_fires_after_its_gradients_are_ready():
    inject.configure(RANK_1, {"TRAINER_FAULT_NAN": "1:2"})
    step = Step()
    inject.into_step(step)
    loss = torch.tensor(1.0)
    step.gradients_ready(1, loss)
    assert step.ready == [1] and loss.isfinite()
    step.gradients_ready(2, loss)
    assert step.ready == [1, 2] and loss.isnan()
    assert all(p.grad.isnan().all() for p in step.model.parameters())
