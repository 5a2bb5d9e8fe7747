"""What a sweep costs beyond its runs: `python -m trainer sweep` against the same runs launched
one by one with `python -m trainer train`, and the sweep's side-by-side packing.

    python -m benchmarks.sweep_overhead [--reps 2] [--steps 30] [--sides SIDE ...] [--name sweep-overhead-DATE]
                                        [--smoke]

The runs: the demo config (the pretrained MiniLM, 2 CPU ranks a run), 2 learning rates x 2
seeds, `--steps` steps each, one evaluation at the end. The sides (--sides; the first three
unless named), alternating, the order reversed every other repetition:

- `one by one`: the 4 runs as 4 `torchrun --nproc-per-node=2 -m trainer train` launches, one
  after another, as a user scripts them;
- `sweep`: `python -m trainer sweep` of the same grid, `sweep.parallel=1` (each run on both
  ranks, one after another: the same packing), so the difference is the sweep's own cost
  (its process, Optuna's journal, the leaderboard, the figure, final/);
- `sweep, 2 at once`: `sweep.parallel=2`, each run on 1 rank with 1 thread, two side by side,
  each run forked from the sweep's zygote (sweep.preload, the default);
- `sweep, 2 at once, afresh`: the same with `sweep.preload=false`: each run a fresh torchrun.

Each side of each repetition starts from an empty `datasets` cache (HF_DATASETS_CACHE), so each
tokenizes the split once and its later runs read that cache, whatever the side. Per side: the
wall seconds for all 4 runs, the CPU seconds of every process (user + system), and for a
sweep its runs' own "launch to first step" (trial.log), the first `parallel` of them (which
wait for the zygote's imports, or their own) apart from the later ones. Writes
benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name, run_interleaved

LRS = (5e-5, 1e-4)
SIDES = ["one by one", "sweep", "sweep, 2 at once", "sweep, 2 at once, afresh"]
SEEDS = 2
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "PYTHONUNBUFFERED": "1"}


def common(data: Path, steps: int) -> list[str]:
    return [f"data.path={data}", f"train.max_steps={steps}", f"train.eval_every={steps}", "checkpoint.every=0",
            "wandb.mode=disabled", "tracking.curves=false"]


def sweep_config(work: Path, lrs: tuple[float, ...], seeds: int) -> Path:
    """configs/demo.yaml with the sweep's section."""
    config = work / "sweep.yaml"
    config.write_text((REPO / "configs/demo.yaml").read_text() + f"""
sweep:
  parameters:
    train.lr: [{", ".join(map(str, lrs))}]
  seeds: {seeds}
""")
    return config


def one_side(side: str, work: Path, data: Path, steps: int, lrs: tuple[float, ...] = LRS, seeds: int = SEEDS,
             extra: Sequence[str] = ()) -> dict:
    """`side`'s runs of the grid `lrs` x `seeds`, each with `extra` overrides before its own."""
    out, cache = work / "out", work / "hf-datasets"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_"))},
           **ENV, "HF_DATASETS_CACHE": str(cache)}
    if side == "one by one":
        commands = [[sys.executable, "-m", "trainer.cli.torchrun", "--standalone", "--nproc-per-node=2", "-m",
                     "trainer", "train", "-c", "configs/demo.yaml", *extra, *common(data, steps), f"train.lr={lr}",
                     f"seed={seed}", f"output_dir={out / f'lr{lr}-seed{seed}'}"]
                    for lr in lrs for seed in range(seeds)]
    else:
        parallel = 1 if side == "sweep" else 2
        afresh = ["sweep.preload=false"] if side.endswith("afresh") else []
        commands = [[sys.executable, "-m", "trainer", "sweep", "-c", str(sweep_config(work, lrs, seeds)), *extra,
                     *common(data, steps), f"output_dir={out}", f"sweep.parallel={parallel}", "sweep.ranks=2",
                     *afresh]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    for command in commands:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{side}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    measured = {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}
    if side != "one by one":
        measured.update(trial_launches(out / "trials", parallel))
    return measured


LAUNCH = re.compile(r"^(\S+ \S+) .*launch to first step ([\d.]+)s", re.M)


def trial_launches(trials: Path, parallel: int) -> dict[str, float | None]:
    """The median "launch to first step" of the sweep's first `parallel` runs, and of the later
    ones (None where there are none), in the order their lines were written."""
    found = sorted(line.groups() for log in trials.glob("*/trial.log") for line in LAUNCH.finditer(log.read_text()))
    seconds = [float(s) for _, s in found]
    return {"first_launch_s": statistics.median(seconds[:parallel]),
            "later_launch_s": statistics.median(seconds[parallel:]) if seconds[parallel:] else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--name", default=f"sweep-overhead-{time.strftime('%Y-%m-%d')}")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=SIDES[:3], metavar="SIDE",
                        help=f"of {SIDES}; the first is the ratios' base")
    smoke.add_flag(parser)
    args = parser.parse_args()
    sides = args.sides
    lrs, seeds, extra, rows = LRS, SEEDS, [], {}
    if args.smoke:
        # One 2-step run of the tiny model a side, ~12 s each: `sweep` is left out (it differs from
        # `sweep, 2 at once` by sweep.parallel alone), and so is the warm-up, one more `sweep`.
        args.reps, args.steps, sides, lrs, seeds = 1, 2, ["one by one", "sweep, 2 at once"], LRS[:1], 1
        extra, rows = smoke.demo_overrides(smoke.folder()), {"num_train": 64, "num_test": 16}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from trainer.data.demo import generate

        data = generate(work / "reviews", **rows)
        if not args.smoke:
            one_side("sweep", work, data, 2)  # warm-up: the page cache of the model and the libraries
        runs = run_interleaved({side: [side] for side in sides}, args.reps,
                               lambda side: one_side(side[0], work, data, args.steps, lrs, seeds, extra),
                               shown=lambda run: {k: v if v is None else round(v, 1) for k, v in run.items()})
    medians = {side: {key: statistics.median(run[key] for run in side_runs) for key in side_runs[0]
                      if side_runs[0][key] is not None}
               for side, side_runs in runs.items()}
    base = medians[sides[0]]["wall_s"]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
              "python": platform.python_version(), "what": __doc__.split("\n\n")[0], "steps": args.steps,
              "runs": runs, "medians": medians,
              "wall_over_the_first_side": {side: m["wall_s"] / base for side, m in medians.items()}}
    out = smoke.results_path(f"{args.name}.json", args.smoke)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("medians", "wall_over_the_first_side")}, indent=1))


if __name__ == "__main__":
    main()
