"""What the small before/after benchmarks share: sides run in an order that alternates each
repetition (so drift over a session falls on both alike), and the CPU they ran on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def run_interleaved(sides: dict[str, list[str]], reps: int, one_run: Callable[[list[str]], dict],
                    shown: Callable[[dict], dict] = dict) -> dict[str, list[dict]]:
    """{side: [one_run(its overrides) for each repetition]}, the order reversed every other
    repetition; each result is printed (as `shown` makes it) as it lands."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(reps):
        for side in list(sides) if rep % 2 == 0 else list(reversed(sides)):
            runs[side].append(one_run(sides[side]))
            print(side, shown(runs[side][-1]), flush=True)
    return runs


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
