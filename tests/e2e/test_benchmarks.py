"""Every benchmarks/ driver still runs (issue 72: two were broken by a module move, and nothing
noticed). `python -m benchmarks smoke` runs each one's smoke mode, a tiny random-init model for
a few steps, and fails on any that fails, or that writes into benchmarks/results/. A new
driver is in it by being a program in benchmarks/, and fails it until it has a smoke mode.
What the drivers measure is in benchmarks/RESULTS.md, never asserted here."""

from __future__ import annotations

import re

from support.runs import PYTHON, run

from benchmarks import smoke


def test_every_benchmark_driver_runs_in_its_smoke_mode():
    drivers = smoke.drivers()
    assert {"benchmarks", "benchmarks.launch_budget", "benchmarks.casts", "benchmarks.scoring"} <= set(drivers)
    result = run([PYTHON, "-m", "benchmarks", "smoke"], timeout=1500)
    assert result.returncode == 0, result.output[-8000:]
    assert sorted(re.findall(r"^ok +(\S+)", result.output, flags=re.M)) == sorted(drivers), result.output[-4000:]
