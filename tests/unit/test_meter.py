"""The Meter's arithmetic, driven by a fake clock: no sleeps, no subprocess, exact figures."""

from __future__ import annotations

import pytest
import torch

from trainer.runtime.environment import DistEnv
from trainer.train.flops import FlopModel
from trainer.train.metrics import Meter, PhaseTimer

GLOBAL_BATCH = 2
FLOP_MODEL = FlopModel(linear_params=1000, layers=2, hidden=32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_meter(clock: FakeClock, peak: float | None = 1e5) -> Meter:
    meter = Meter(DistEnv(), torch.device("cpu"), GLOBAL_BATCH, FLOP_MODEL, max_steps=10, peak=peak, clock=clock)
    meter.begin(0)
    return meter


def step(meter: Meter, clock: FakeClock, lengths: list[int], loss: float = 1.0,
         phases: dict[str, float] | None = None) -> None:
    """One training step: a micro-batch of sequences of `lengths`, each phase's seconds."""
    meter.micro_batch(torch.tensor(lengths))
    for name, seconds in (phases or {"forward": 1.0}).items():
        meter.phase(name)
        clock.advance(seconds)
    meter.step_done(torch.tensor(loss), None)


def test_phase_durations_add_up_per_step(clock):
    meter = make_meter(clock)
    phases = {"data": 0.25, "forward": 0.5, "backward": 1.0, "optimizer": 0.25}
    step(meter, clock, [8, 8], phases=phases)
    step(meter, clock, [8, 8], phases={name: 3 * s for name, s in phases.items()})
    window = meter.take_window(epoch=0, lr=1e-3)
    assert {k: v for k, v in window.items() if k.startswith("time/")} == {
        "time/data_s": 0.5, "time/forward_s": 1.0, "time/backward_s": 2.0, "time/optimizer_s": 0.5}
    assert window["samples_per_s"] == 2 * GLOBAL_BATCH / 8.0  # the phases fill the window's 8 s
    assert meter.log_line(2, window).endswith("ms/step: data 500, forward 1000, backward 2000, optimizer 500")


def test_a_phase_can_start_at_an_earlier_time(clock):
    """The exposed-comm phase starts when the last gradient bucket was ready, inside backward."""
    timer = PhaseTimer(clock)
    timer.start("backward")
    clock.advance(3.0)
    timer.start("comm", at=clock() - 1.0)
    clock.advance(0.5)
    timer.start(None)
    assert timer.take() == {"backward": 2.0, "comm": 1.5}
    assert timer.take() == {}


def test_paused_time_counts_in_no_rate(clock):
    meter = make_meter(clock)
    step(meter, clock, [4, 4], phases={"forward": 2.0})
    with meter.paused():  # eval, checkpoints
        clock.advance(100.0)
    step(meter, clock, [4, 4], phases={"forward": 2.0})
    window = meter.take_window(epoch=0, lr=1e-3)
    assert window["samples_per_s"] == 2 * GLOBAL_BATCH / 4.0
    assert window["tokens_per_s"] == 16 / 4.0
    assert window["time/forward_s"] == 2.0
    with meter.paused():  # between windows: the run's totals leave it out too
        clock.advance(50.0)
    assert meter.run_totals() == {"samples_per_s": 2 * GLOBAL_BATCH / 4.0, "train_seconds": 4.0}


def test_a_window_rates_its_own_samples_and_real_tokens(clock):
    meter = make_meter(clock)
    step(meter, clock, [3, 5], loss=1.0, phases={"forward": 1.0})
    step(meter, clock, [8, 2], loss=3.0, phases={"forward": 3.0})
    window = meter.take_window(epoch=1, lr=0.5)
    assert window["loss"] == 2.0 and window["lr"] == 0.5 and window["epoch"] == 1
    assert window["samples_per_s"] == 2 * GLOBAL_BATCH / 4.0
    assert window["tokens_per_s"] == (3 + 5 + 8 + 2) / 4.0  # padding is not a token

    clock.advance(6.0)  # outside any step, still in the new window: the rate counts it
    step(meter, clock, [1, 1], phases={"forward": 2.0})
    second = meter.take_window(epoch=1, lr=0.5)
    assert second["samples_per_s"] == GLOBAL_BATCH / 8.0
    assert second["tokens_per_s"] == 2 / 8.0


def test_mfu_is_model_flops_over_the_peak(clock):
    meter = make_meter(clock, peak=1e5)
    step(meter, clock, [3, 5], phases={"forward": 2.0})
    window = meter.take_window(epoch=0, lr=1e-3)
    flops = FLOP_MODEL.train_flops(tokens=8, sum_squared_lengths=3**2 + 5**2)
    assert flops == 6 * 1000 * 8 + 12 * 2 * 32 * 34
    assert window["mfu"] == pytest.approx(flops / 2.0 / 1e5)
    assert f"MFU {100 * flops / 2.0 / 1e5:.1f}%" in meter.log_line(1, window)


def test_mfu_is_none_when_the_peak_is_unknown(clock):
    meter = make_meter(clock, peak=None)
    step(meter, clock, [3, 5])
    window = meter.take_window(epoch=0, lr=1e-3)
    assert window["mfu"] is None
    assert "MFU unknown" in meter.log_line(1, window)


def test_mfu_cannot_exceed_100_percent(clock, caplog):
    """A measured peak the model beats (a CPU's matmul timed on a busy machine) is no peak:
    MFU is unknown from then on, not above 100%."""
    meter = make_meter(clock, peak=1e5)
    step(meter, clock, [8, 8], phases={"forward": 1e-3})  # ~1e8 FLOP/s against a "peak" of 1e5
    window = meter.take_window(epoch=0, lr=1e-3)
    assert window["mfu"] is None and "MFU unknown" in meter.log_line(1, window)
    assert "above the peak of 1e+05" in caplog.text
    step(meter, clock, [1, 1], phases={"forward": 1e3})  # slow enough for the old peak: still unknown
    assert meter.take_window(epoch=0, lr=1e-3)["mfu"] is None
