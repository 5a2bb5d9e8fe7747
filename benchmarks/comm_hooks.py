"""Gradient compression on a slow link: the demo (MiniLM, all its 150 steps) across two
nodes, one rank each, whose links are shaped to 500 Mb/s, with each ddp.comm_hook;
interleaved. samples/s, the final validation accuracy, and the bytes the links carried.

    python -m benchmarks.comm_hooks [--reps 2] [--steps 150] [--data data/reviews] [--smoke]

Root: the nodes are network namespaces (tests/support/netns.py), each with one core of its own and a
token bucket on its egress. samples/s is summary.json's (after the first step, evaluation and
saves excluded). Writes results/cpu-minilm-comm-hooks-500mbit.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.interleaved import REPO, demo_main
from trainer.runtime.launch import torchrun_argv, trainer_program

sys.path.insert(0, str(REPO / "tests"))
from support.netns import Network

RESULTS = Path(__file__).with_name("results") / "cpu-minilm-comm-hooks-500mbit.json"
RATE_MBIT = 500
"""MiniLM sends ~45 MB of dense gradients a step; at 500 Mb/s that is ~0.8 s on the wire per
node, against ~0.2 s of compute on one core: a link-bound step, as on 10 GbE with a GPU."""
SIDES = {"none": ["ddp.comm_hook=none"], "bf16": ["ddp.comm_hook=bf16"], "fp16": ["ddp.comm_hook=fp16"],
         "powersgd r=1": ["ddp.comm_hook=powersgd", "ddp.powersgd_rank=1"],
         "powersgd r=4": ["ddp.comm_hook=powersgd", "ddp.powersgd_rank=4"]}


def one_run(data: str, steps: int, extra: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out, Network({"node0": [], "node1": []}, rate_mbit=RATE_MBIT) as net:
        settings = [f"data.path={data}", f"output_dir={out}/run", f"train.max_steps={steps}", "wandb.mode=disabled",
                    "checkpoint.every=0", *extra]
        procs = []
        for host in ("node0", "node1"):
            argv = torchrun_argv(1, trainer_program("train", config="configs/demo.yaml", overrides=settings),
                                 nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="bench")
            procs.append(net.spawn(host, argv, env, REPO, log=Path(out) / f"{host}.log"))
        if net.wait(procs, timeout=3600) != [0, 0]:
            raise SystemExit((Path(out) / "node0.log").read_text()[-3000:])
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
        sent = sum(net.shaped_bytes(host) for host in ("node0", "node1"))
    return {"samples_per_s": summary["samples_per_s"], "accuracy": summary["final_eval"]["accuracy"],
            "bytes_sent_per_step": sent / summary["steps"], "final_eval": summary["final_eval"]}


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in ("samples_per_s", "accuracy",
                                                                         "bytes_sent_per_step")}


if __name__ == "__main__":
    # Smoke: one hook (a side costs ~15 s, its two nodes); every side runs the same code with another override.
    demo_main(RESULTS, SIDES, one_run, medians, reps=2, steps=150, smoke_sides=("powersgd r=1",))
