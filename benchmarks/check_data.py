"""How long `python -m trainer check` takes to read and check a user's data before a job starts:
seconds, where tokenizing the same 400,000 rows takes the job 14-27 s (RESULTS.md, 2026-11-24).

    python -m benchmarks.check_data [--rows 400000] [--smoke]

Writes a CSV of `--rows` reviews with label names and no validation split (trainer.data.demo's
`sentiment` shape), then times `check` on it as a new process, three times: cold (an empty
`datasets` cache: the CSV is converted to Arrow), then warm (the cache read). Each run also holds
out the validation split (stratified), resolves and counts the labels in Arrow and tokenizes a
seeded sample of 2,000 rows per split. Writes results/cpu-minilm-check-data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name
from trainer.data import demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    smoke.add_flag(parser)
    args = parser.parse_args()
    runs = 3
    if args.smoke:  # the cold run only, of 200 rows: a warm run is the same command again
        args.rows, runs = 200, 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = demo.sentiment(work / "data", args.rows, seed=0)
        env = {**os.environ, "HF_DATASETS_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1"}
        command = [sys.executable, "-m", "trainer", "check", "-c", "configs/demo.yaml", f"data.path={path}",
                   "data.text_field=review", "data.label_field=sentiment", "data.num_labels=null",
                   "data.label_names=null", f"output_dir={work / 'run'}", "world_size=2"]
        seconds, report = [], ""
        for _ in range(runs):
            started = time.perf_counter()
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True)
            seconds.append(round(time.perf_counter() - started, 2))
            report = done.stdout.strip()  # check's report is all it prints on stdout
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "rows": args.rows,
              "cold_s": seconds[0], "warm_s": seconds[1:], "report": report}
    smoke.results_path("cpu-minilm-check-data.json", args.smoke).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
