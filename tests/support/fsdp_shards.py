"""What one FSDP rank holds, from its local shards, beside the memory plan: run under
torchrun by tests/e2e/test_fsdp.py. For each case, builds the model as a training run does
(trainer/train/build.py), takes one optimizer step, then prints one JSON line per rank: the case, its
local bytes of weights, gradients and AdamW state, the whole model's, and the plan's.

Arguments: one or more cases, each `case=NAME` then its config overrides (`case=full a=1 b=2
case=lora a=1 c=3`): one launch, one process group, for all of them."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from trainer.cli import run_config
from trainer.data import labels
from trainer.preflight import memory
from trainer.runtime import environment
from trainer.train import build

dist_env, cpu = environment.read_env(), torch.device("cpu")
dist.init_process_group("gloo")


def local(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in tensors)


def cases(args: list[str]) -> list[tuple[str, list[str]]]:
    """[(NAME, overrides)] of `case=NAME overrides... case=NAME overrides...`."""
    groups: list[tuple[str, list[str]]] = []
    for arg in args:
        if arg.startswith("case="):
            groups.append((arg.removeprefix("case="), []))
        else:
            groups[-1][1].append(arg)
    return groups


def measure(case: str, overrides: list[str]) -> None:
    cfg = run_config.load("configs/demo.yaml", overrides)
    run_labels = labels.from_config(cfg.data)
    whole_model = build.load(cfg, environment.DistEnv(), cpu, torch.float32, run_labels).model  # unsharded, to count
    whole = sum(t.numel() * t.element_size() for t in whole_model.parameters())
    whole_trained = sum(t.numel() * t.element_size() for t in whole_model.parameters() if t.requires_grad)
    built = build.build(cfg, dist_env, cpu, run_labels, max_steps=1)
    bare, optimizer = built.model, built.step.optimizer
    ids = torch.randint(5, 100, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    built.step.loss(batch).backward()
    optimizer.step()
    params = list(bare.parameters())
    held = {"weights": local(params) + sum(b.numel() * b.element_size() for b in bare.buffers()),
            "gradients": local(p.grad for p in params if p.requires_grad),
            "optimizer": sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * 4
                             for state in optimizer.state.values() for t in state.values()),
            "whole_weights": whole, "whole_trained": whole_trained,
            "buffers": sum(b.numel() * b.element_size() for b in bare.buffers())}
    plan = memory.make(cfg, run_labels, cpu, dist_env.world_size)
    # One write of the whole line: the ranks share torchrun's stdout, and print() writes the text
    # and its newline apart, between which another rank's line can land (seen on a loaded machine).
    sys.stdout.write(json.dumps({"case": case, "rank": dist_env.rank, **held, "plan": {
        "weights": plan.weights, "gradients": plan.gradients, "optimizer": plan.optimizer}}) + "\n")
    sys.stdout.flush()


for name, case_overrides in cases(sys.argv[1:]):
    measure(name, case_overrides)
dist.destroy_process_group()
