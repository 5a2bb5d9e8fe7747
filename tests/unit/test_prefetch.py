"""A rank that waits at local_rank_zero_first's barrier does the imports it needs next
(distributed.meanwhile, startup.Prefetch); the barrier stays the same one."""

from __future__ import annotations

import sys

import pytest

from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.runtime.startup import Prefetch


class SlowBarrier:
    """dist.barrier's Work, passed after `polls` calls of is_completed()."""

    def __init__(self, polls: int):
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def barriers(monkeypatch):
    """The barriers local_rank_zero_first waits at, each passed after 3 polls; a plain
    (blocking) one is recorded as None."""
    made: list[SlowBarrier | None] = []

    def barrier(async_op=False):
        made.append(SlowBarrier(3) if async_op else None)
        return made[-1]

    monkeypatch.setattr(distributed.dist, "barrier", barrier)
    monkeypatch.setattr(distributed, "all_gather", lambda dist_env, value: [None, value])  # local rank 0 did well
    monkeypatch.setattr(distributed, "_ALREADY_THERE_S", 0.0)
    return made


RANK_1 = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="localhost", master_port=1)


def test_a_waiting_rank_works_until_the_barrier_is_passed_then_waits_on_it(barriers):
    passed_at_call = []

    def work() -> bool:
        barrier = barriers[-1]
        assert barrier is not None
        passed_at_call.append(barrier.polls < 0)
        return True

    with distributed.meanwhile(work), distributed.local_rank_zero_first(RANK_1, "data"):
        pass
    barrier = barriers[0]
    assert passed_at_call and not any(passed_at_call)  # called while waiting, never after
    assert barrier is not None and barrier.polls < 0 and barrier.waited
    assert not distributed._meanwhile


def test_work_that_runs_out_leaves_the_rank_waiting_on_the_barrier(barriers):
    left = [True, False]
    with distributed.meanwhile(lambda: left.pop(0)), distributed.local_rank_zero_first(RANK_1, "data"):
        pass
    barrier = barriers[0]
    assert left == [] and barrier is not None and barrier.waited


def test_a_barrier_the_others_already_wait_at_is_passed_without_work(barriers, monkeypatch):
    monkeypatch.setattr(distributed, "_ALREADY_THERE_S", 5.0)  # passed at the 4th poll, long before
    calls = []
    with distributed.meanwhile(lambda: calls.append(1) or True), distributed.local_rank_zero_first(RANK_1, "data"):
        pass
    barrier = barriers[0]
    assert calls == [] and barrier is not None and barrier.waited


def test_without_work_the_barrier_is_the_plain_one(barriers):
    with distributed.local_rank_zero_first(RANK_1, "data"):
        pass
    assert barriers == [None]


def test_prefetch_imports_one_module_a_call_and_skips_those_imported(monkeypatch):
    for name in ("json", "colorsys", "this_module_does_not_exist"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import json  # noqa: F401  (imported already: skipped)

    prefetch = Prefetch(["json", "colorsys", "this_module_does_not_exist", "wave"])
    assert prefetch() and "colorsys" in sys.modules
    # A module that fails to import stops the prefetch: its error is for the code that needs it.
    assert not prefetch() and "this_module_does_not_exist" not in sys.modules
    assert not prefetch()
