"""LoRA against full fine-tuning on the demo model (MiniLM), 2 CPU ranks, interleaved:
samples/s, the gradient bytes DDP all-reduces per step, checkpoint size and save time.

    python -m benchmarks.lora_vs_full [--reps 3] [--steps 60] [--data data/reviews] [--smoke]

Each run is `torchrun --nproc-per-node=2 -m trainer train -c configs/demo.yaml` with
`train.max_steps=STEPS`, a checkpoint every 20 steps, and with or without `model.lora.r=16`
(alpha 32, lr 1e-3).
samples/s is summary.json's (after the first step, evaluation and saves excluded); save
seconds are metrics.jsonl's `checkpoint/save_s`. The gradient bytes are the trained
parameters' fp32 gradients, which DDP's buckets hold and all-reduce once per step (a ring
all-reduce then sends about twice that per rank). Full fine-tuning's input embedding goes
through the all-reduce as sparse rows on CPU (ddp.sparse_embedding_grad), so its real
traffic is below its figure. Writes results/cpu-minilm-lora-vs-full.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.interleaved import REPO, demo_command, demo_main

RESULTS = Path(__file__).with_name("results") / "cpu-minilm-lora-vs-full.json"
SIDES = {"full": [], "lora r=16": ["model.lora.r=16", "model.lora.alpha=32", "train.lr=1e-3"]}
"""LoRA at 10x the demo's lr: at 1e-4 its loss stays at ln 5 for these 60 steps (the
adapters start at zero and move slowly); the speed figures don't depend on it."""


def one_run(data: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run(demo_command(data, steps, out, extra), cwd=REPO, env=env, check=True, capture_output=True)
        summary = json.loads((Path(out) / "summary.json").read_text())
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        step_dir = Path(out) / "checkpoints" / f"step-{steps}"
        sizes = {p.name: p.stat().st_size for p in step_dir.iterdir()}
    return {
        "samples_per_s": summary["samples_per_s"],
        "trained_parameters": summary["trained_parameters"],
        "parameters": summary["parameters"],
        "gradient_bytes_per_step": 4 * summary["trained_parameters"],
        "checkpoint_bytes": sum(sizes.values()),
        "checkpoint_files": sizes,
        "save_s": [r["checkpoint/save_s"] for r in records if "checkpoint/save_s" in r],
        "final_eval": summary["final_eval"],
    }


def medians(runs: list[dict]) -> dict:
    return {"samples_per_s": statistics.median(run["samples_per_s"] for run in runs),
            "save_s": statistics.median(s for run in runs for s in run["save_s"]),
            "checkpoint_bytes": statistics.median(run["checkpoint_bytes"] for run in runs),
            "gradient_bytes_per_step": runs[0]["gradient_bytes_per_step"]}


if __name__ == "__main__":
    demo_main(RESULTS, SIDES, one_run, medians, reps=3)
