"""Load a run's final/ with plain transformers (no trainer code) and evaluate it.

    python benchmarks/load_final.py RUN_DIR TEST.jsonl [--out result.json]

The accuracy it measures (fp32, batch by batch on one device) is set beside the one the
trainer reported in RUN_DIR/summary.json (bf16 autocast, sharded over ranks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("test", type=Path)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForSequenceClassification.from_pretrained(args.run_dir / "final").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.run_dir / "final")
    rows = [json.loads(line) for line in args.test.read_text().splitlines() if line.strip()]
    correct = 0
    with torch.no_grad():
        for start in range(0, len(rows), 128):
            chunk = rows[start:start + 128]
            batch = tokenizer([r["text"] for r in chunk], truncation=True, max_length=args.max_length,
                              padding=True, return_tensors="pt").to(device)
            predicted = model(**batch).logits.argmax(-1).cpu()
            correct += sum(int(p) == r["label"] for p, r in zip(predicted, chunk))
    summary = json.loads((args.run_dir / "summary.json").read_text())
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "module_prefixes": sum(k.startswith("module.") for k in model.state_dict()),
              "plain_transformers_accuracy": correct / len(rows), "samples": len(rows),
              "trainer_final_eval": summary["final_eval"], "steps": summary["steps"],
              "world_size": summary["world_size"], "global_batch": summary["global_batch"],
              "samples_per_s": summary["samples_per_s"], "startup_s": summary["startup_s"]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
