"""Kill drill: N random SIGKILL points in a two-node job under `torchrun --max-restarts`.

A benchmark, not part of `make test` (about 25 s a point):

    .venv/bin/python tests/support/kill_drill.py --points 20 [--seed 0]

Each point SIGKILLs one worker (random rank, random step) of a 40-step two-node job (network
namespaces, as in test_multinode_faults.py). torchrun restarts every worker, training
resumes from the last valid checkpoint, and the final weights are compared bitwise with an
uninterrupted run. Prints a line per point and writes benchmarks/results/kill-drill.json.
The target is every point matching.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support

from support import multinode
from support.models import make_tiny_model
from support.netns import Network
from support.outputs import read_summary
from support.runs import REPO, tiny_overrides
from support.weights import compare_weights

STEPS = 40
OPTIONS = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 5, "checkpoint.keep": 2,
           "train.log_every": 5}
NODES = {"node0": [], "node1": []}


def run_job(workdir: Path, model: Path, data: Path, env: dict[str, str]) -> tuple[list[int | None], Path]:
    out = workdir / "run"
    with Network(NODES) as net:
        procs = multinode.launch(net, workdir / "logs", tiny_overrides(model, data, out, **OPTIONS),
                                 torchrun_args=("--max-restarts=2",), env=env)
        codes = net.wait(list(procs.values()), timeout=300)
    return codes, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    points = [f"{rng.randrange(2)}:{rng.randint(2, STEPS)}" for _ in range(args.points)]

    from trainer.data.demo import generate

    base = Path(tempfile.mkdtemp(prefix="kill-drill-"))
    model = make_tiny_model(base / "model", dropout=0.1)
    data = generate(base / "data", num_train=600, num_test=203, seed=1)
    codes, reference = run_job(base / "reference", model, data, {})
    assert codes == [0, 0], f"the uninterrupted run failed: {codes}, logs in {base / 'reference'}"

    results = []
    for i, point in enumerate(points):
        started = time.monotonic()
        codes, out = run_job(base / f"point-{i}", model, data, {"TRAINER_FAULT_SIGKILL": point})
        matched = codes == [0, 0] and not compare_weights(reference, out, STEPS).differing
        summary = read_summary(out) if (out / "summary.json").exists() else {}
        results.append({"kill": point, "exit_codes": codes, "resumed_from_step": summary.get("resumed_from_step"),
                        "bitwise_equal": matched, "seconds": round(time.monotonic() - started, 1)})
        print(f"point {i + 1:>2}/{len(points)}: kill rank:step {point:>5} -> exit {codes}, resumed from "
              f"{summary.get('resumed_from_step')}, {'MATCH' if matched else 'MISMATCH'}", flush=True)

    matched = sum(r["bitwise_equal"] for r in results)
    print(f"{matched}/{len(results)} kill points resumed to bitwise-identical weights (seed {args.seed})")
    report = {"date": time.strftime("%Y-%m-%d"), "steps": STEPS, "seed": args.seed, "matched": matched,
              "points": results}
    if matched == len(results):
        shutil.rmtree(base)
    else:
        print(f"logs of every run kept in {base}")
    target = REPO / "benchmarks" / "results" / "kill-drill.json"
    target.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {target}")
    return 0 if matched == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
