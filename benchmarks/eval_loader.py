"""Evaluation with the eval loader in the process (as the trainer does since 2026-11-24) against
one persistent loader worker (as before), interleaved, on the demo config: MiniLM, the demo
data's 1000 eval samples, one process on the CPU.

    python -m benchmarks.eval_loader [--reps 8] [--data data/reviews] [--smoke]

Prints each side's seconds per full evaluation and writes them to
results/cpu-minilm-eval-loader.json. The first evaluation of the worker side includes forking
its worker; the ratio is taken over the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks import smoke
from trainer.cli import run_config
from trainer.data import loaders, reading
from trainer.data.batch_plan import BatchPlan
from trainer.runtime import environment
from trainer.train import build, evaluation

RESULTS = Path(__file__).with_name("results") / "cpu-minilm-eval-loader.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--data", default="data/reviews")
    smoke.add_flag(parser)
    args = parser.parse_args()
    tiny = []
    if args.smoke:  # 16 eval samples of the tiny model; 2 repetitions, as the ratio leaves out each side's first
        args.reps, tiny = 2, smoke.demo_overrides(smoke.folder())

    cfg = run_config.load("configs/demo.yaml", [f"data.path={args.data}", "output_dir=/tmp/eval-loader-bench", *tiny])
    dist_env, device = environment.read_env(), torch.device("cpu")
    splits = reading.load(cfg, dist_env)
    built_run = build.build(cfg, dist_env, device, splits.labels, max_steps=1)  # the model as training evaluates it
    logits_of, tokenizer = built_run.logits, built_run.tokenizer
    assert logits_of is not None, "build() parallelized the model"
    built = loaders.build(cfg, dist_env, splits, tokenizer, device, BatchPlan.of(cfg.train, 1))
    in_process = built.eval_loader
    worker = DataLoader(in_process.dataset, batch_size=in_process.batch_size, sampler=in_process.sampler,
                        **loaders._loader_options(cfg, tokenizer, device))
    assert (in_process.num_workers, worker.num_workers) == (0, 1)

    seconds = {"in_process": [], "one_worker": []}
    try:
        for rep in range(args.reps):
            order = [("in_process", in_process), ("one_worker", worker)]
            for name, loader in order if rep % 2 == 0 else reversed(order):
                started = time.perf_counter()
                evaluation.evaluate(logits_of, loader, built.num_eval, built_run.task, device, dist_env)
                seconds[name].append(round(time.perf_counter() - started, 3))
    finally:  # Data.close ends the worker, which blocks SIGTERM: the exit would wait for it
        dataclasses.replace(built, eval_loader=worker).close()
    ratio = statistics.median(seconds["one_worker"][1:]) / statistics.median(seconds["in_process"][1:])
    result = {"date": time.strftime("%Y-%m-%d"), "eval_samples": built.num_eval, "threads": torch.get_num_threads(),
              "seconds": seconds, "one_worker_over_in_process_median": round(ratio, 3)}
    smoke.results_path(RESULTS.name, args.smoke).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
