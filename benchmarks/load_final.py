"""Load a run's final/ with plain transformers (no trainer code) and evaluate it.

    python benchmarks/load_final.py RUN_DIR TEST.jsonl [--out result.json]
    python -m benchmarks.load_final --smoke

The accuracy it measures (fp32, batch by batch on one device) is set beside the one the
trainer reported in RUN_DIR/summary.json (bf16 autocast, sharded over ranks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]


def smoke_run(work: Path, smoke) -> Path:
    """A run folder to load, for --smoke: the tiny random-init model as final/ and a
    summary.json of the fields read here, stand-ins (no run trained it)."""
    run = work / "run"
    shutil.copytree(smoke.tiny_model(work), run / "final", dirs_exist_ok=True)
    (run / "summary.json").write_text(json.dumps({"final_eval": {}, "steps": 0, "world_size": 1, "global_batch": 0,
                                                  "samples_per_s": 0.0, "startup_s": {}}) + "\n")
    return run


def main() -> None:
    sys.path.insert(0, str(REPO))  # benchmarks.smoke, where this runs as a script (benchmarks/gpu.sh)
    from benchmarks import smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR")
    parser.add_argument("test", type=Path, nargs="?", metavar="TEST.jsonl")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--out", type=Path)
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        work = smoke.folder()
        args.run_dir, args.test = smoke_run(work, smoke), Path(smoke.tiny_data(work)) / "test.jsonl"
        args.max_length, args.out = 32, args.out or smoke.results_path("load-final.json", smoke=True)
    elif args.test is None:
        parser.error("RUN_DIR and TEST.jsonl are required")

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
            correct += sum(int(p) == r["label"] for p, r in zip(predicted, chunk, strict=True))
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
