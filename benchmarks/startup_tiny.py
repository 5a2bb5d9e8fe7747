"""Launch to first step of the test suite's kind of run, before and after a change: the tiny
random-init BERT (tests/support/models.py), 2 CPU ranks, 4 steps, fp32, no wandb,
no curves (tests/support/runs.py's tiny_overrides), one launch at a time.

    python -m benchmarks.startup_tiny --side before=/tmp/wt-before --side after=/tmp/wt-after \
        [--reps 5] [--name startup-2026-11-28-tiny] [--smoke]

Each side is a source tree (`git archive REV | tar -x -C DIR`), run with this .venv: its
`python -m trainer.cli.torchrun --standalone --nproc-per-node=2 -m trainer train ...` from that
tree, in the suite's environment (OMP_NUM_THREADS=1, offline). The sides alternate, the order
reversed every other repetition, after one warm-up launch each. Per launch: rank 0's phases
(summary.json's startup_s) and their sum, the launch's wall time to exit, and the CPU time
of the launcher and both ranks (user + system). Writes benchmarks/results/<--name>.json.
`--smoke`: this tree alone (no --side), one launch on 64 rows, no warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name, run_interleaved

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def fixtures(work: Path, train: int = 600, test: int = 203) -> tuple[Path, Path]:
    """The tiny model and the reviews, made as the suite's fixtures make them."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.models import make_tiny_model

    from trainer.data.demo import generate

    return make_tiny_model(work / "tiny", dropout=0.0), generate(work / "reviews", train, test, seed=1)


def one_launch(tree: Path, model: Path, data: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    overrides = {"model.name": model, "data.path": data, "data.num_labels": 5, "data.max_length": 64,
                 "data.num_workers": 0, "train.precision": "fp32", "train.lr": 1e-3, "train.warmup_ratio": 0.1,
                 "train.log_every": 2, "train.eval_batch_size": 32, "train.max_steps": 4,
                 "wandb.mode": "disabled", "tracking.curves": False, "output_dir": out}
    cmd = [sys.executable, "-m", "trainer.cli.torchrun", "--standalone", "--nproc-per-node=2", "-m", "trainer", "train",
           *(f"{key}={value}" for key, value in overrides.items())]
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    started = time.time()
    done = subprocess.run(cmd, cwd=tree, env={**env, **ENV}, capture_output=True, text=True)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    phases = json.loads((out / "summary.json").read_text())["startup_s"]
    return {"launch_to_first_step_s": sum(phases.values()), "startup_s": phases, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load_average_1min_before": load}


def medians(runs: list[dict]) -> dict:
    keys = ["launch_to_first_step_s", "wall_s", "cpu_s"]
    summary = {key: statistics.median(run[key] for run in runs) for key in keys}
    summary["startup_s"] = {phase: statistics.median(run["startup_s"][phase] for run in runs)
                            for phase in runs[0]["startup_s"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", action="append", help="NAME=TREE, in the order they first run (required)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--name", default=f"startup-{time.strftime('%Y-%m-%d')}-tiny")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.side, args.reps = [f"this tree={REPO}"], 1
    elif not args.side:
        parser.error("--side NAME=TREE is required")
    trees = {name: Path(tree) for name, tree in (side.split("=", 1) for side in args.side)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = fixtures(work, *((64, 16) if args.smoke else ()))
        if not args.smoke:  # the timed launch's call again, ~10 s: a smoke run skips it
            for tree in trees.values():  # warm-up: the page cache, the `datasets` cache of the reviews
                one_launch(tree, model, data, work / "run")
        runs = run_interleaved({name: [str(tree)] for name, tree in trees.items()}, args.reps,
                               lambda side: one_launch(Path(side[0]), model, data, work / "run"),
                               shown=lambda run: {k: round(v, 2) for k, v in run.items() if k != "startup_s"})
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
              "python": platform.python_version(), "what": __doc__.split("\n\n")[0],
              "sides": {name: str(tree) for name, tree in trees.items()}, "runs": runs,
              "medians": {name: medians(side_runs) for name, side_runs in runs.items()}}
    out = smoke.results_path(f"{args.name}.json", args.smoke)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
