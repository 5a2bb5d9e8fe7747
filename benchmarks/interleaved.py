"""What the small before/after benchmarks share: sides run in an order that alternates each
repetition (so drift over a session falls on both alike), the CPU they ran on, and the peak
memory of a torchrun's ranks."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import smoke

REPO = Path(__file__).resolve().parents[1]


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


def demo_command(data: str, steps: int, output_dir: str, extra: list[str]) -> list[str]:
    """torchrun of the demo config on 2 CPU ranks for `steps` steps, a checkpoint every 20
    (all kept), no evaluation and no wandb, with `extra` overrides."""
    settings = [f"data.path={data}", f"output_dir={output_dir}", f"train.max_steps={steps}", "checkpoint.every=20",
                "checkpoint.keep=10", "train.eval_every=0", "wandb.mode=disabled", *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "trainer", "train", "-c", "configs/demo.yaml", *settings]


def demo_main(results: Path, sides: dict[str, list[str]], one_run: Callable[[str, int, list[str]], dict],
              medians: Callable[[list[dict]], dict], reps: int, steps: int = 60,
              smoke_sides: tuple[str, ...] = ()) -> None:
    """A demo-config benchmark's command line (--reps, --steps, --data, --smoke): `one_run(data,
    steps, overrides)` for each side, interleaved; `medians` of each side's runs printed, and
    written to `results` with every run, the date and the CPU. --smoke runs `smoke_sides`
    only (default: every side), once, for 4 steps of the tiny model."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--data", default=str(REPO / "data/reviews"))
    smoke.add_flag(parser)
    args = parser.parse_args()
    tiny: list[str] = []
    if args.smoke:  # the tiny model's overrides come after the data's, so they win
        args.reps, args.steps, results = 1, 4, smoke.results_path(results.name, smoke=True)
        tiny = smoke.demo_overrides(smoke.folder())
        sides = {side: sides[side] for side in smoke_sides or sides}
        RankMemory.every_s = 0.2

    runs = run_interleaved(sides, args.reps, lambda extra: one_run(args.data, args.steps, [*tiny, *extra]),
                           shown=lambda run: {k: v for k, v in run.items() if k != "checkpoint_files"})
    summary = {side: medians(side_runs) for side, side_runs in runs.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "python": platform.python_version(),
              "steps": args.steps, "runs": runs, "medians": summary}
    results.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


class RankMemory:
    """`with RankMemory(torchrun_proc) as peak:` samples the RSS and PSS of the torchrun's
    workers every 20 ms (every_s) from /proc, summed over them, and keeps their peaks (GiB),
    and the largest RSS of one worker. RSS counts a page in every process that maps it (a
    model file's page cache, once per rank); PSS splits shared pages among the processes that
    map them, so its sum is what the node really holds for the ranks."""

    every_s = 0.02
    """Seconds between samples. Reading smaps_rollup walks a worker's page tables and slows
    it: ~2 s of a tiny run's 11, which a smoke run (measuring nothing) saves with 0.2."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.rss_gib = self.pss_gib = self.max_rank_rss_gib = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def __enter__(self) -> RankMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.is_set():
            per_rank = [_memory_kib(pid) for pid in _children(self.proc.pid)]
            if per_rank:
                self.rss_gib = max(self.rss_gib, sum(r for r, _ in per_rank) / 2**20)
                self.pss_gib = max(self.pss_gib, sum(p for _, p in per_rank) / 2**20)
                self.max_rank_rss_gib = max(self.max_rank_rss_gib, max(r for r, _ in per_rank) / 2**20)
            time.sleep(self.every_s)


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) once it is gone."""
    try:
        rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])
        pss = int(Path(f"/proc/{pid}/smaps_rollup").read_text().split("\nPss:")[1].split()[0])
        return rss, pss
    except (OSError, IndexError):
        return 0, 0


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
