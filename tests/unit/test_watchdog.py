"""The stall watchdog's limits and reports, driven by a fake clock and `check(now)`: no
thread, no sleeps, no process group."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import trainer.outputs.ending
import trainer.train.loop
from trainer.exit_codes import Exit
from trainer.faults.watchdog import PHASES, Watchdog, verdict
from trainer.runtime.environment import DistEnv

FACTOR, MIN_S, TIMEOUT_S = 10.0, 1.0, 100.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reports(monkeypatch) -> list[str]:
    found: list[str] = []
    monkeypatch.setattr(Watchdog, "report", lambda self, what: found.append(what))
    return found


@pytest.fixture
def watchdog(clock, tmp_path) -> Watchdog:
    cfg = OmegaConf.create({"fault": {"slow_step_factor": FACTOR, "slow_step_min_s": MIN_S, "heartbeat_s": 5.0},
                            "dist": {"init_timeout_s": TIMEOUT_S}})
    return Watchdog(cfg, DistEnv(), tmp_path, clock=clock)


def run_steps(watchdog: Watchdog, clock: FakeClock, seconds: float, count: int = 5) -> int:
    """`count` steps of `seconds` each; the next step's number."""
    for step in range(1, count + 1):
        watchdog.step_started(step)
        clock.now += seconds
        watchdog.check(clock.now)
        watchdog.step_done()
    return count + 1


def limit_of_a_stalled_step(watchdog: Watchdog, clock: FakeClock, reports: list[str], step: int) -> float:
    """Start `step`, then find the time past which it is reported, to the millisecond."""
    started = clock.now
    watchdog.step_started(step)
    elapsed = 0.0
    while not reports:
        elapsed = round(elapsed + 0.001, 3)
        watchdog.check(started + elapsed)
    return round(elapsed - 0.001, 3)


def test_a_stalled_step_is_reported_once_after_its_limit_and_not_before(watchdog, clock, reports):
    step = run_steps(watchdog, clock, 0.5)  # limit: 10 x 0.5
    watchdog.step_started(step)
    started = clock.now
    watchdog.check(started + 5.0)
    assert reports == []
    watchdog.check(started + 5.01)
    assert len(reports) == 1
    for later in (6.0, 50.0, 500.0):
        watchdog.check(started + later)
    assert len(reports) == 1
    assert reports[0] == (f"stalled in train step at step {step}: has run 5.0s (recent step median 0.50s, "
                          "limit 5.0s); the job may be hung")


def test_the_next_stalled_step_is_reported_again(watchdog, clock, reports):
    step = run_steps(watchdog, clock, 0.5)
    watchdog.step_started(step)
    watchdog.check(clock.now + 6)
    clock.now += 6
    watchdog.step_done()
    watchdog.step_started(step + 1)
    watchdog.check(clock.now + 6)
    assert [r.split(":")[0] for r in reports] == [f"stalled in train step at step {step}",
                                                  f"stalled in train step at step {step + 1}"]


@pytest.mark.parametrize("step_s, limit", [
    (0.5, FACTOR * 0.5),  # factor x median
    (0.01, MIN_S),  # at least min_s
    (9.0, 0.75 * TIMEOUT_S),  # capped under the collective timeout
])
def test_step_limit_is_factor_times_median_at_least_min_and_capped(watchdog, clock, reports, step_s, limit):
    step = run_steps(watchdog, clock, step_s)
    assert limit_of_a_stalled_step(watchdog, clock, reports, step) == pytest.approx(limit)


def test_the_limit_follows_the_median_not_the_mean(watchdog, clock, reports):
    for step, seconds in enumerate([0.2, 0.2, 0.2, 0.2, 30.0], start=1):
        watchdog.step_started(step)
        clock.now += seconds
        watchdog.step_done()
    assert limit_of_a_stalled_step(watchdog, clock, reports, 6) == pytest.approx(FACTOR * 0.2)


def test_the_first_step_and_a_lowered_timeout_cap_the_limit(watchdog, clock, reports):
    assert limit_of_a_stalled_step(watchdog, clock, reports, 1) == pytest.approx(0.75 * TIMEOUT_S)
    clock.now += 80
    watchdog.step_done()  # median 80 s: 10 x 80 s would be far past the lowered timeout
    reports.clear()
    watchdog.set_timeout(4.0)  # after the first step: dist.timeout_s
    assert limit_of_a_stalled_step(watchdog, clock, reports, 2) == pytest.approx(0.75 * 4.0)


def test_a_phase_uses_the_timeout_not_the_step_median(watchdog, clock, reports):
    step = run_steps(watchdog, clock, 0.01)
    with watchdog.phase("eval", step):
        started = clock.now
        watchdog.check(started + 0.75 * TIMEOUT_S)
        assert reports == []
        watchdog.check(started + 0.75 * TIMEOUT_S + 0.01)
    assert len(reports) == 1
    assert reports[0].startswith(f"stalled in eval at step {step}: has run 75.0s (recent step median 0.01s, "
                                 "limit 75.0s)")
    watchdog.check(clock.now + 1000)  # the phase is over: nothing is watched
    assert len(reports) == 1


def test_nothing_is_reported_between_steps(watchdog, clock, reports):
    run_steps(watchdog, clock, 0.5)
    watchdog.check(clock.now + 1000)
    assert reports == []


def test_the_report_names_the_phase_and_step_and_keeps_the_stacks(watchdog, clock, tmp_path):
    with watchdog.phase("save", 20):
        watchdog.check(clock.now + 80)
    stacks = (tmp_path / "stacks" / "rank-0.txt").read_text()
    assert "rank 0 on " in stacks and ": stalled in checkpoint save at step 20: has run 80.0s (limit 75.0s)" in stacks
    assert "Python stacks of rank 0 follow" in stacks
    assert "test_the_report_names_the_phase_and_step_and_keeps_the_stacks" in stacks  # this thread's stack


def test_every_phase_the_trainer_watches_can_be_reported(watchdog, clock, reports):
    """A phase missing from PHASES would end the watchdog thread with a KeyError instead of a report."""
    sources = [Path(module.__file__).read_text() for module in (trainer.train.loop, trainer.outputs.ending)]
    called = r'(?:watch|watchdog\.phase|(?<![.\w])phase)\("([\w-]+)"'
    watched = {name for source in sources for name in re.findall(called, source)}
    assert {"eval", "save", "final-eval", "load-best", "test-eval", "export", "gather"} <= watched
    for phase in sorted(watched):
        with watchdog.phase(phase, 7):
            watchdog.check(clock.now + TIMEOUT_S)
        assert reports.pop().startswith(f"stalled in {PHASES[phase]} at step 7")


def test_a_peer_late_once_is_no_suspect_after_a_step_that_it_took_part_in(watchdog, clock):
    """A report in step 3 found node2 silent; step 3 then completed, all-reducing with node2. A
    crash in step 4 is a crash, not a node fault of node2."""
    watchdog.step_started(3)
    watchdog.silent_hosts.add("node2")
    assert watchdog_verdict(watchdog) == (Exit.NODE_FAULT, ["node2"])
    watchdog.step_done()
    watchdog.step_started(4)
    assert watchdog_verdict(watchdog) == (Exit.CRASH, [])


def watchdog_verdict(watchdog: Watchdog) -> tuple[Exit, list[str]]:
    return verdict(RuntimeError("a bug"), watchdog.silent_hosts)
