"""Start-up cost against the data size: launch to first step, phase by phase, on the demo's
kind of data at several sizes, for the first launch on a cold `datasets` cache and for the
next one (the same training in a new output_dir, as every new run has).

    python -m benchmarks.startup_vs_data [--rows 40000 400000] [--baseline REV] [--reps 1] [--smoke]

Each launch is the issue's command: `torchrun --standalone --nproc-per-node=2 -m trainer train
-c configs/demo.yaml data.path=... output_dir=... train.max_steps=3`; its phases come from
summary.json (startup_s), and the cache-*.arrow files it added to HF_DATASETS_CACHE say
whether it tokenized. With --baseline, the same launches also run from git revision REV (a
worktree), interleaved with this tree's, each side on a cache of its own. Then tokenization
alone, in one process on the converted split: in process against num_proc (the trainer's
rule, data.tokenize_processes, for local rank 0). `--smoke`: this tree alone, 64 rows, the
tiny model, the cold launch only.

Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.__main__ import REPO, Worktree
from trainer.runtime.launch import torchrun_argv, trainer_program


def lscpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def launch(cwd: Path, data: Path, out: Path, cache: Path, timeout: float, extra: list[str]) -> dict:
    """One training launch, with `extra` overrides; its phases, and the map cache files it wrote."""
    before = set(cache.rglob("cache-*.arrow"))
    program = trainer_program("train", "configs/demo.yaml",  # `data` after `extra`, so that it wins
                              [*extra, f"data.path={data}", f"output_dir={out}", "train.max_steps=3"])
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(torchrun_argv(2, program), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed in {cwd}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    startup = {phase: round(s, 2) for phase, s in summary["startup_s"].items()}
    written = sorted(p.name for p in set(cache.rglob("cache-*.arrow")) - before)
    log = [line.split("trainer.data.encoding: ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
           if "trainer.data.encoding: " in line and "_split" in line]
    return {"startup_s": startup, "launch_to_first_step_s": round(sum(startup.values()), 2),
            "wall_s": round(wall, 1), "cache_files_written": written, "data_log": log}


def tokenize_in_process(data_dir: Path, cache: Path, reps: int, extra: list[str]) -> dict:
    """The train split's map alone, in process and with the trainer's num_proc, on the split
    as converted (each map into a cache file of its own, removed after); `extra` overrides."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the trainer sets it
    import datasets

    from trainer.cli import run_config
    from trainer.data import encoding
    from trainer.model import pretrained
    from trainer.runtime.environment import DistEnv

    datasets.disable_progress_bars()
    cfg = run_config.load("configs/demo.yaml", [*extra, f"data.path={data_dir}"])
    tokenizer = pretrained.load_tokenizer(cfg.model)
    ds = datasets.load_dataset(str(data_dir), split="train", cache_dir=str(cache))
    max_length = int(cfg.data.max_length)

    def encode(batch):  # encoding.tokenize_split's
        encoded = tokenizer(batch["text"], None, truncation=True, max_length=max_length)
        encoded["labels"] = batch["label"]
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    processes = encoding.tokenize_processes(len(ds), DistEnv())
    sides = {"in_process": None, **({f"num_proc={processes}": processes} if processes else {})}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(reps):
        for name, num_proc in sides.items():
            started = time.perf_counter()
            tokenized = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc,
                               load_from_cache_file=False, new_fingerprint=f"bench-{rep}-{num_proc}")
            seconds[name].append(round(time.perf_counter() - started, 2))
            for file in tokenized.cache_files:
                os.remove(file["filename"])
    return {"rows": len(ds), "cpus": len(os.sched_getaffinity(0)), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[40_000, 400_000])
    parser.add_argument("--baseline", metavar="REV", help="also launch git revision REV (a worktree)")
    parser.add_argument("--reps", type=int, default=1, help="cold+warm launch pairs per size and side")
    parser.add_argument("--tokenize-reps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--name", default="cpu-minilm-startup-vs-data")
    smoke.add_flag(parser)
    args = parser.parse_args()
    test_rows, extra, launches = 1000, [], (1, 2)
    if args.smoke:  # the cold launch only: the warm one is the same call again, and a launch costs ~10 s
        args.rows, args.baseline, args.reps, args.tokenize_reps, test_rows, launches = [64], None, 1, 1, 16, (1,)
        extra = smoke.demo_overrides(smoke.folder())

    from trainer.data.demo import generate

    baseline = Worktree(args.baseline) if args.baseline else None
    sides = {"after": REPO, **({f"before ({args.baseline})": baseline.path} if baseline else {})}
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": lscpu_model(), "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "what": "torchrun --standalone --nproc-per-node=2 -m trainer train -c configs/demo.yaml "
                "train.max_steps=3 on python -m trainer.data.demo --train ROWS --test 1000; launch 1 on an empty "
                "HF_DATASETS_CACHE (JSON conversion and tokenization), launch 2 the same in a new output_dir",
        "launches": {}, "tokenize_in_process": {},
    }
    work = Path(tempfile.mkdtemp(prefix="startup-vs-data-"))
    try:
        for rows in args.rows:
            data = generate(work / f"data-{rows}", num_train=rows, num_test=test_rows)
            runs: dict[str, list] = {side: [] for side in sides}
            for rep in range(args.reps):
                caches = {side: work / f"hf-{i}-{rows}-{rep}" for i, side in enumerate(sides)}
                for k in launches:  # interleaved: each side's launch k, then the next k
                    for i, (side, cwd) in enumerate(sides.items()):
                        out = work / f"run-{i}-{rows}-{rep}-{k}"
                        record = launch(cwd, data, out, caches[side], args.timeout, extra)
                        runs[side].append({"rep": rep, "launch": k, **record})
                        print(f"{rows} rows, {side}, launch {k}: {record['startup_s']} "
                              f"wrote {len(record['cache_files_written'])} cache files", flush=True)
                        shutil.rmtree(out)
                for cache in caches.values():
                    shutil.rmtree(cache, ignore_errors=True)
            results["launches"][str(rows)] = runs
            tokenized = tokenize_in_process(data, work / f"hf-tokenize-{rows}", args.tokenize_reps, extra)
            results["tokenize_in_process"][str(rows)] = tokenized
            print(f"{rows} rows, tokenize in process: {tokenized['seconds']}", flush=True)
            shutil.rmtree(work / f"hf-tokenize-{rows}", ignore_errors=True)
            shutil.rmtree(data)
    finally:
        if baseline is not None:
            baseline.remove()
        shutil.rmtree(work, ignore_errors=True)
    out = smoke.results_path(f"{args.name}.json", args.smoke)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
