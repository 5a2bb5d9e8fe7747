"""Is training bitwise reproducible on this device, with `train.deterministic` off and on?

A measurement, not part of `make test` (about a minute on a GPU host):

    .venv/bin/python tests/support/determinism_check.py [--modes off on]

For each mode: two uninterrupted 40-step runs of the tiny dropout BERT (2 gloo ranks), and
one run SIGKILLed (rank 1, step 23) then resumed. It reports whether the second run and the
resumed run end bitwise equal to the first, and the largest weight difference if not. The
modes run side by side. Writes benchmarks/results/determinism-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support

from support.models import make_tiny_model
from support.outputs import read_summary
from support.runs import REPO, run, tiny_overrides, trainer_command
from support.weights import compare_weights

STEPS = 40
OPTIONS = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 5, "train.log_every": 5,
           "dist.backend": "gloo"}


def check(mode: str, base: Path, model: Path, data: Path) -> dict:
    options = {**OPTIONS, "train.deterministic": mode == "on"}
    outs = {name: base / mode / name for name in ("first", "second", "resumed")}
    for name in ("first", "second"):
        result = run(trainer_command(tiny_overrides(model, data, outs[name], **options), nproc=2))
        assert result.returncode == 0, result.output[-4000:]
    overrides = tiny_overrides(model, data, outs["resumed"], **options)
    killed = run(trainer_command(overrides, nproc=2), env={"TRAINER_FAULT_SIGKILL": "1:23"})
    assert killed.returncode != 0, killed.output[-4000:]
    resumed = run(trainer_command(overrides, nproc=2))
    assert resumed.returncode == 0, resumed.output[-4000:]
    summary = read_summary(outs["resumed"])
    report = {"deterministic": mode == "on", "resumed_from_step": summary["resumed_from_step"]}
    for name in ("second", "resumed"):
        diff = compare_weights(outs["first"], outs[name], STEPS)
        report[f"{name}_bitwise_equal_to_first"] = not diff.differing
        report[f"{name}_tensors_differing"] = len(diff.differing)
        report[f"{name}_max_abs_difference"] = diff.max_abs
    return report


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"

    from trainer.data.demo import generate

    base = Path(tempfile.mkdtemp(prefix="determinism-"))
    model = make_tiny_model(base / "model", dropout=0.1)
    data = generate(base / "data", num_train=600, num_test=203, seed=1)
    started = time.monotonic()
    with ThreadPoolExecutor(len(args.modes)) as pool:
        reports = list(pool.map(lambda mode: check(mode, base, model, data), args.modes))
    for report in reports:
        print(json.dumps(report))
    target = REPO / "benchmarks" / "results" / f"determinism-{device.replace(' ', '-').lower()}.json"
    target.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
                                  "steps": STEPS, "kill": "1:23", "seconds": round(time.monotonic() - started),
                                  "modes": reports}, indent=2) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
