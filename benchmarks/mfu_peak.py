"""Where MFU's CPU peak is measured, before and after issue 35: launch to first step and the
MFU it reports, interleaved, on the demo config (MiniLM, one process, bf16).

    python -m benchmarks.mfu_peak --before /path/to/old/checkout [--reps 3] [--data data/reviews] [--smoke]

Each side runs `python -m trainer train` from its own tree. "emulated" holds torch's and
oneDNN's kernels to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), as on a CPU without
AVX512-BF16 or AMX; "native" runs as the machine is. Writes
results/cpu-minilm-mfu-peak-before-after.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import cpu_name

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("results") / "cpu-minilm-mfu-peak-before-after.json"
CPUS = {"native": {}, "emulated": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def one_run(tree: Path, data: str, cpu: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        settings = [f"data.path={data}", f"output_dir={out}", "train.precision=bf16", "train.max_steps=6",
                    "train.log_every=2", "train.batch_size=8", "data.max_length=64", "checkpoint.every=0",
                    "data.max_eval_samples=16", "data.num_workers=0", "wandb.mode=disabled", *extra]
        env = {**os.environ, **CPUS[cpu], "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run([sys.executable, "-m", "trainer", "train", "-c", "configs/demo.yaml", *settings], cwd=tree,
                       env=env, check=True, capture_output=True)
        summary = json.loads((Path(out) / "summary.json").read_text())
        windows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"launch_to_first_step_s": round(sum(summary["startup_s"].values()), 2),
            "setup_s": round(summary["startup_s"]["setup"], 2),
            "mfu": [w["mfu"] for w in windows if "samples_per_s" in w]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path,
                        help="a checkout of the trainer before the change (required; --smoke: this tree)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", default=str(REPO / "data/reviews"))
    smoke.add_flag(parser)
    args = parser.parse_args()
    cpus, tiny = list(CPUS), []
    if args.smoke:  # this tree as both sides, on the emulated CPU only (the one with variables to pass)
        args.before, args.reps, cpus = args.before or REPO, 1, ["emulated"]
        tiny = [*smoke.demo_overrides(smoke.folder()), "train.max_steps=4"]  # after one_run's settings: they win
    if args.before is None:
        parser.error("--before is required")

    runs: dict = {cpu: {"before": [], "after": []} for cpu in cpus}
    for rep in range(args.reps):
        for cpu in cpus:
            order = [("before", args.before), ("after", REPO)]
            for side, tree in order if rep % 2 == 0 else reversed(order):
                runs[cpu][side].append(one_run(tree, args.data, cpu, tiny))
                print(cpu, side, runs[cpu][side][-1], flush=True)
    medians = {cpu: {side: {key: statistics.median(r[key] for r in rs)
                            for key in ("launch_to_first_step_s", "setup_s")} for side, rs in sides.items()}
               for cpu, sides in runs.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "runs": runs, "medians": medians}
    smoke.results_path(RESULTS.name, args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
