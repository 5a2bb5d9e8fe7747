"""A forecast on paper, not a measurement: trainer/preflight/forecast.py's model, validated on shaped
CPU links (benchmarks/forecast.py), extrapolated to 8-512 H100s over published link speeds.

    python -m benchmarks.forecast_paper [--smoke]     # prints the markdown tables, writes the JSON

Every input is stated here, and RESULTS.md repeats them:
- bert-base, batch 512 per GPU, seq 128, bf16: 74 ms a step on one H100, split as the profile
  split it (RESULTS.md, 2026-11-23): forward 35 ms, backward 32 ms, optimizer 7 ms.
- Llama-3.1-8B with LoRA (configs/llama8b_lora.yaml: r 16 on q/k/v/o, 4 x 512 tokens per GPU,
  bf16): not measured. Its step is trainer/train/flops.py's count at an assumed 40% MFU of the
  H100's 989 TFLOP/s dense bf16, split forward 1/3, backward 2/3.
- Links, as NCCL's bus bandwidth and per-hop latency: NVLink inside a node (8 GPUs, 360 GB/s,
  nccl-tests' typical all-reduce on an H100 HGX), and between nodes 100 GbE with one NIC per
  node (11 GB/s, 20 us), 200 Gb/s InfiniBand with 8 NICs per node (180 GB/s, 5 us) or 400 Gb/s
  with 8 NICs per node (360 GB/s, 5 us), each at ~90% of the line rate. The ring model's latency
  grows with the ranks while NCCL switches to trees at scale: at 256-512 GPUs its latency term
  is pessimistic. It does not matter for these buckets, whose bytes dominate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks import smoke
from benchmarks.__main__ import ARCHS
from trainer.cli import run_config
from trainer.data import labels
from trainer.preflight import forecast
from trainer.runtime.environment import DistEnv
from trainer.strategies.ddp import DDP
from trainer.strategies.traffic import Param
from trainer.train import build
from trainer.train.flops import FlopModel

RESULTS = "forecast-h100-paper.json"
LLAMA = Path(__file__).parents[1] / "configs/models/llama-3.1-8b"
GPUS_PER_NODE = 8
NODES = (1, 2, 4, 8, 16, 32, 64)
NVLINK = forecast.Link(latency_s=3e-6, busbw=360e9)
LINKS = {"100 GbE": forecast.Link(20e-6, 11e9), "200 Gb/s IB x8": forecast.Link(5e-6, 180e9),
         "400 Gb/s IB x8": forecast.Link(5e-6, 360e9)}
H100_BF16_FLOPS = 989e12


def meta_model(folder: Path, *overrides: str):
    """The classifier of `folder`'s config.json on the meta device, as the trainer builds it
    (trainer/train/build.py) for a bf16 GPU run with `overrides` (LoRA's, say)."""
    cfg = run_config.load(None, [f"model.name={folder}", "data.path=unused", "data.num_labels=5", "data.max_length=512",
                             "train.max_steps=1", "output_dir=unused", *overrides])
    return build.load(cfg, DistEnv(), torch.device("cuda"), torch.bfloat16, labels.from_config(cfg.data),
                      on_meta=True).model


def jobs(tiny: bool = False) -> dict[str, tuple]:
    """`tiny`: both models 2 layers of width 32, their other settings kept (the smoke run)."""
    from transformers import BertConfig, LlamaConfig

    with tempfile.TemporaryDirectory() as folder:
        BertConfig(num_labels=5, **(ARCHS["tiny"] if tiny else {})).save_pretrained(f"{folder}/bert")
        bert = meta_model(Path(folder, "bert"))
        llama_folder = Path(folder, "llama") if tiny else LLAMA
        if tiny:
            LlamaConfig.from_pretrained(LLAMA, **ARCHS["tiny"], num_key_value_heads=1, head_dim=16).save_pretrained(
                llama_folder)
        llama = meta_model(llama_folder, "model.lora.r=16", "model.lora.alpha=32",
                           "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    bert_compute = forecast.Compute(forward_s=0.035, backward_s=0.032, optimizer_s=0.007, micro_batch=512)
    tokens = 4 * 512
    step_s = FlopModel.of(llama).train_flops(tokens, 4 * 512**2) / (0.4 * H100_BF16_FLOPS)
    llama_compute = forecast.Compute(step_s / 3, 2 * step_s / 3, 0.002, micro_batch=4)
    return {"bert-base (full)": (bert, bert_compute), "Llama-3.1-8B (LoRA r=16)": (llama, llama_compute)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    smoke.add_flag(parser)
    args = parser.parse_args()
    settings = OmegaConf.create({"train": {"strategy": "ddp"},
                                 "ddp": {"bucket_cap_mb": 25.0, "sparse_embedding_grad": False, "comm_hook": "none",
                                         "powersgd_rank": 4}})
    out: dict = {"assumptions": __doc__, "gpus_per_node": GPUS_PER_NODE, "forecast": {}}
    for job, (model, compute) in jobs(tiny=args.smoke).items():
        traffic = DDP(settings).traffic(Param.all_of(model), "nccl", 0)
        single = compute.forward_s + compute.backward_s + compute.optimizer_s
        print(f"\n{job}: {traffic.nbytes / 1e6:.1f} MB of gradients a step, {single * 1e3:.0f} ms of compute\n")
        print("| GPUs | " + " | ".join(LINKS) + " |")
        print("|---" * (len(LINKS) + 1) + "|")
        rows = []
        for nodes in NODES:
            world = nodes * GPUS_PER_NODE
            cells = {}
            for name, link in LINKS.items():
                step = forecast.step_seconds(compute, traffic, NVLINK if nodes == 1 else link, world)
                cells[name] = {"step_s": step, "efficiency": single / step}
            rows.append({"gpus": world, **cells})
            print(f"| {world} | " + " | ".join(f"{c['step_s'] * 1e3:.0f} ms, {c['efficiency']:.0%}"
                                              for c in cells.values()) + " |")
        out["forecast"][job] = {"gradient_bytes": traffic.nbytes, "compute_s": single, "rows": rows}
    smoke.results_path(RESULTS, args.smoke).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
