"""What one FSDP rank holds, from its local shards, beside the memory plan: run under
torchrun by tests/e2e/test_fsdp.py. Builds the model as a training run does (trainer/build.py),
takes one optimizer step, then prints one JSON line per rank: its local bytes of weights,
gradients and AdamW state, the whole model's, and the plan's."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from trainer import build, config, distributed, labels
from trainer.preflight import memory

cfg = config.load("configs/demo.yaml", sys.argv[1:])
dist_env, cpu = distributed.read_env(), torch.device("cpu")
dist.init_process_group("gloo")
run_labels = labels.from_config(cfg.data)
whole_model = build.load(cfg, distributed.DistEnv(), cpu, torch.float32, run_labels).model  # unsharded, to count
whole = sum(t.numel() * t.element_size() for t in whole_model.parameters())
whole_trained = sum(t.numel() * t.element_size() for t in whole_model.parameters() if t.requires_grad)
built = build.build(cfg, dist_env, cpu, run_labels, max_steps=1)
bare, optimizer = built.model, built.step.optimizer
ids = torch.randint(5, 100, (2, 16))
built.step.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}).backward()
optimizer.step()


def local(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in tensors)


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
sys.stdout.write(json.dumps({"rank": dist_env.rank, **held, "plan": {
    "weights": plan.weights, "gradients": plan.gradients, "optimizer": plan.optimizer}}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
