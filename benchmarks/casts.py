"""The casts of a bf16 training step, counted on the CPU, for each way to hold the weights
(issue 58, item 4).

    python -m benchmarks.casts [--shape bert-base] [--grad-accum 1 4] [--smoke]

Autocast casts every fp32 weight a matmul reads to bf16, and each gradient back, every
micro-batch: on a GPU, a kernel launch and a pass over the weight's memory each. Counted here,
per optimizer step after two warm-up steps, on a bare step (forward, backward, fused AdamW:
the ways differ in what they cast, not in the rest of the training step):

- anew: autocast entered in each micro-batch's forward (the trainer until 2026-11-28);
- kept: one region held open over the step's micro-batches, so that autocast's cache keeps
  each weight's bf16 copy (trainer/train/step.py's `_casts_kept`: the same bits);
- bf16 weights: the model itself in bf16, fp32 master weights in the optimizer, one foreach
  copy of the gradients to the masters and one of the masters back (not the trainer's);
- fsdp: FSDP2 on a process group of one rank, its MixedPrecisionPolicy gathering the weights
  in bf16 and reducing the gradients in fp32 (train.strategy=fsdp), against FSDP2 in fp32
  under autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.launch_budget import SHAPES, counter_module


def model(shape: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    dims = {**SHAPES[shape], "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    made = BertForSequenceClassification(BertConfig(vocab_size=30522, num_labels=5, attn_implementation="sdpa",
                                                    **dims))
    return made.train()


def micro_batches(grad_accum: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 30522, (4, 32), generator=generator),
             "labels": torch.randint(0, 5, (4,), generator=generator)} for _ in range(grad_accum)]


def forward_backward(net: torch.nn.Module, batches: list[dict[str, torch.Tensor]], sharded: bool = False) -> None:
    for i, batch in enumerate(batches):
        if sharded:  # reduce-scatter after the last micro-batch only, as train.strategy=fsdp does
            net.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = net(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"]) / len(batches)
        loss.backward()


def autocast_step(shape: str, kept: bool):
    net = model(shape)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)

    def step(batches):
        with torch.autocast("cpu", enabled=False) if kept else contextlib.nullcontext():
            forward_backward(net, batches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bf16_weights_step(shape: str):
    net = model(shape)
    masters = [p.detach().clone() for p in net.parameters()]
    for master in masters:
        master.grad = torch.zeros_like(master)
    net.to(torch.bfloat16)
    weights = list(net.parameters())
    optimizer = torch.optim.AdamW(masters, fused=True)

    def step(batches):
        forward_backward(net, batches)
        torch._foreach_copy_([m.grad for m in masters], [w.grad for w in weights])
        optimizer.step()
        torch._foreach_copy_([w.detach() for w in weights], masters)
        for weight in weights:
            weight.grad = None

    return step


def fsdp_step(shape: str, policy: bool):
    from torch.distributed.fsdp import fully_shard

    from trainer.strategies.fsdp import fully_shard_model

    net = model(shape)
    if policy:
        fully_shard_model(net, reshard_after_forward=True, amp_dtype=torch.bfloat16)
    else:
        fully_shard(net)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)

    def step(batches):
        with torch.autocast("cpu", enabled=False):
            forward_backward(net, batches, sharded=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


WAYS = {"anew": lambda shape: autocast_step(shape, kept=False), "kept": lambda shape: autocast_step(shape, kept=True),
        "bf16 weights": bf16_weights_step, "fsdp, fp32 under autocast": lambda shape: fsdp_step(shape, policy=False),
        "fsdp, MixedPrecisionPolicy": lambda shape: fsdp_step(shape, policy=True)}


def count(way: str, shape: str, grad_accum: int, perf_counts) -> dict[str, int]:
    step, batches = WAYS[way](shape), micro_batches(grad_accum)
    for _ in range(2):
        step(batches)
    with perf_counts.StepCounts() as counts:
        step(batches)
    return {"ops": counts.totals()["ops"], "casts": counts.copies["aten::_to_copy"],
            "copies": counts.totals()["copies"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="bert-base", choices=sorted(SHAPES))
    parser.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, help="default: results/casts-SHAPE.json")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # every way, on the tiny shape, one micro-batch
        args.shape, args.grad_accum = "tiny", [1]
    out = args.out or smoke.results_path(f"casts-{args.shape}.json", args.smoke)
    torch.set_num_threads(1)
    import torch.distributed as dist

    perf_counts = counter_module()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    try:
        print(f"{args.shape}, bf16, per optimizer step: ops / _to_copy casts / all copies")
        for way in WAYS:
            for grad_accum in args.grad_accum:
                got = results[f"{way}, grad_accum={grad_accum}"] = count(way, args.shape, grad_accum, perf_counts)
                print(f"  {way:28s} grad_accum={grad_accum}: {got['ops']:6d} {got['casts']:5d} {got['copies']:5d}",
                      flush=True)
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps({"shape": args.shape, "torch": torch.__version__, "counts": results}, indent=1)
                        + "\n")


if __name__ == "__main__":
    main()
