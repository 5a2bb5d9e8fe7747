"""FSDP against DDP on the demo model (MiniLM, full fine-tuning), 2 CPU ranks, interleaved:
samples/s, each rank's memory, and each rank's checkpoint share.

    python -m benchmarks.fsdp_vs_ddp [--reps 2] [--steps 60] [--data data/reviews] [--smoke]

Each run is `torchrun --nproc-per-node=2 -m trainer train -c configs/demo.yaml` with
`train.max_steps=STEPS`, a checkpoint every 20 steps, with `train.strategy` ddp or fsdp.
samples/s is summary.json's (after the first step, evaluation and saves excluded). Memory is
sampled from /proc every 20 ms (RankMemory): the peak of the ranks' PSS summed, halved, and
the largest RSS of one rank. The checkpoint's largest file is what one rank writes under
FSDP (its shard), and rank 0's whole model.safetensors + optimizer.pt under DDP. Writes
results/cpu-minilm-fsdp-vs-ddp.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.interleaved import REPO, RankMemory, demo_command, demo_main

RESULTS = Path(__file__).with_name("results") / "cpu-minilm-fsdp-vs-ddp.json"
SIDES = {"ddp": ["train.strategy=ddp"], "fsdp": ["train.strategy=fsdp"]}


def one_run(data: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.Popen(demo_command(data, steps, out, extra), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with RankMemory(proc) as peak:
            _, stderr = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(stderr[-3000:])
        summary = json.loads((Path(out) / "summary.json").read_text())
        step_dir = Path(out) / "checkpoints" / f"step-{steps}"
        sizes = {p.relative_to(step_dir).as_posix(): p.stat().st_size for p in step_dir.rglob("*") if p.is_file()}
    largest = max(sizes.values()) if "sharded/.metadata" in sizes else \
        sizes["model.safetensors"] + sizes["optimizer.pt"]
    return {"samples_per_s": summary["samples_per_s"], "pss_per_rank_gib": peak.pss_gib / 2,
            "max_rank_rss_gib": peak.max_rank_rss_gib, "checkpoint_bytes_written_by_one_rank": largest,
            "checkpoint_files": sizes, "final_eval": summary["final_eval"]}


def medians(runs: list[dict]) -> dict:
    keys = ("samples_per_s", "pss_per_rank_gib", "max_rank_rss_gib", "checkpoint_bytes_written_by_one_rank")
    return {key: statistics.median(run[key] for run in runs) for key in keys}


if __name__ == "__main__":
    demo_main(RESULTS, SIDES, one_run, medians, reps=2)
