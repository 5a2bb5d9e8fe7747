"""What the check of every step's loss and gradient norm (fault.max_bad_steps) costs: its
all-reduce of two numbers over 2 gloo ranks and the host sync after it, against one training
step of the demo's model (MiniLM-L6) and of a bert-base-shaped one, as a rank computes it (one
thread, bf16 where native).

    torchrun --standalone --nproc-per-node=2 -m benchmarks.loss_guard [--checks 500] [--reps 5]
    python -m benchmarks.loss_guard --smoke

Reported by rank 0: the median of `checks` checks (after 20 to warm up), the median of `reps`
steps of each model, and the check's share of each step. The gradient norm the check reads is
clipping's (train.max_grad_norm, on by default), so it adds no pass over the gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from benchmarks import smoke
from benchmarks.replica_digest import models, timed, training_step
from trainer.faults.numerics import LossGuard
from trainer.runtime.environment import DistEnv


def check_seconds(checks: int) -> float:
    env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), master_addr="localhost", master_port=1)
    guard = LossGuard(OmegaConf.create({"max_bad_steps": 3, "spike_factor": 10.0, "rollback_on_spike": False}), env)
    loss, norm = torch.tensor(0.7), torch.tensor(1.3)
    seconds = []
    for i in range(20 + checks):
        started = time.perf_counter()
        guard.judge(loss, norm, scaler_skips_overflow=False)
        if i >= 20:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def step_seconds(model_dir: str, work: Path, reps: int) -> float:
    """A step as a run builds it, the check off: what the check is compared with."""
    _, step = training_step(model_dir, work, "fault.max_bad_steps=0", "fault.spike_factor=0")
    step()  # warm-up: allocation, the optimizer's state
    return statistics.median(timed(step) for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=500)
    parser.add_argument("--reps", type=int, default=5)
    smoke.add_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:  # no torchrun: a group of one, whose all-reduce the check still makes (DistEnv has a master)
        args.checks, args.reps = 5, 1
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    check_s = check_seconds(args.checks)
    if dist.get_rank() == 0:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            steps = {name: step_seconds(model, work, args.reps) for name, model in models(work, args.smoke).items()}
        print(json.dumps({"check_s": check_s, "ranks": dist.get_world_size(),
                          "steps": {name: {"step_s": s, "check_per_step": check_s / s} for name, s in steps.items()}},
                         indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
