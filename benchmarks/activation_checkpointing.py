"""What model.gradient_checkpointing saves and costs: peak host memory and samples/s, with and
without, full fine-tuning and LoRA, interleaved, on the demo model (MiniLM) on CPU.

    python -m benchmarks.activation_checkpointing [--reps 2] [--batch-size 128] [--data data/reviews] [--smoke]

One process (`python -m trainer train -c configs/demo.yaml`), fp32, `train.max_steps=12`, no
checkpoints or evaluation before the end. On CPU the activations live in host memory, so the
process's peak resident set (ru_maxrss, read by a wrapper process that runs only it) shows
them. It also holds the interpreter, the weights, AdamW's state and the data, which are
the same with and without. Writes results/cpu-minilm-activation-checkpointing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import cpu_name, run_interleaved

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("results") / "cpu-minilm-activation-checkpointing.json"
SIDES = {
    "full": [], "full + checkpointing": ["model.gradient_checkpointing=true"],
    "lora": ["model.lora.r=16"], "lora + checkpointing": ["model.lora.r=16", "model.gradient_checkpointing=true"],
}
# Runs the trainer as its only child, then prints that child's peak RSS in KiB.
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def one_run(data: str, batch_size: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        settings = [f"data.path={data}", f"output_dir={out}", "train.max_steps=12", f"train.batch_size={batch_size}",
                    "train.precision=fp32", "train.log_every=4", "checkpoint.every=0", "train.eval_every=0",
                    "data.max_eval_samples=64", "wandb.mode=disabled", *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        trainer = [sys.executable, "-m", "trainer", "train", "-c", "configs/demo.yaml", *settings]
        peak = subprocess.run([sys.executable, "-c", PEAK_RSS, *trainer], cwd=REPO, env=env, check=True,
                              capture_output=True, text=True).stdout.split()[-1]
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"peak_rss_gib": int(peak) / 2**20, "samples_per_s": summary["samples_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--data", default=str(REPO / "data/reviews"))
    smoke.add_flag(parser)
    args = parser.parse_args()
    sides, tiny = SIDES, []
    if args.smoke:  # 2 of the 4 sides (one run costs ~6 s), which between them hold both switches
        sides = {side: SIDES[side] for side in ("full", "lora + checkpointing")}
        args.reps, args.batch_size = 1, 8
        # The tiny model for 4 steps: these come after one_run's settings, so they win.
        tiny = [*smoke.demo_overrides(smoke.folder()), "train.max_steps=4", "train.log_every=2"]

    runs = run_interleaved(sides, args.reps, lambda extra: one_run(args.data, args.batch_size, [*tiny, *extra]))
    medians = {side: {key: statistics.median(r[key] for r in rs) for key in ("peak_rss_gib", "samples_per_s")}
               for side, rs in runs.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "batch_size": args.batch_size, "runs": runs,
              "medians": medians}
    smoke.results_path(RESULTS.name, args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
