"""Launching the trainer as a user does: `python -m trainer` and torchrun as processes (forked from a
preloaded interpreter where they can be, support/preloaded.py), each run's output and exit status,
runs at once, a kill then a resume, and the tiny run's overrides."""

from __future__ import annotations

import hashlib
import os
import queue
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import preloaded
from support.processes import kill_tree
from trainer.runtime.launch import torchrun_argv, trainer_program

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PYTHON = sys.executable

# A process of one rank takes every core (train.threads), and OpenMP's threads spin between
# parallel regions by default: beside the other pytest session's runs they spun on the cores the
# others needed, and a tiny model's step took 10x longer, for 30% more CPU. Waiting passively
# changes no result, only who gets the cores. Read when torch loads OpenMP: set here, when
# conftest.py imports this module, before any test imports torch, for this process and every
# one it starts (BASE_ENV, the preloaded servers').
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Offline and quiet: nothing may come from a hub, and runs must not steal each other's cores.
BASE_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}
for _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
    BASE_ENV.pop(_name, None)


def tiny_overrides(model: Path, data: Path, output_dir: Path, **extra) -> list[str]:
    """A short fp32 run of the tiny model: fast, and exact enough to compare weights. wandb and
    the curves are off, as tests that need them say."""
    settings = {
        "model.name": model, "data.path": data, "data.num_labels": 5, "data.max_length": 64,
        "data.num_workers": 0, "train.precision": "fp32", "train.lr": 1e-3, "train.warmup_ratio": 0.1,
        "train.log_every": 2, "train.eval_batch_size": 32, "train.max_steps": 4, "wandb.mode": "disabled",
        "tracking.curves": False,  # a second of matplotlib per run: tests/e2e/test_report.py draws them
        "output_dir": output_dir, **extra,
    }
    return [f"{key}={value}" for key, value in settings.items()]


@dataclass
class Reference:
    run: Path
    """The run's output_dir."""
    launched: Any = None
    """Whatever the launcher returned (a Slurm job's record, say)."""


def locally(nproc: int | None) -> Callable[[list[str], Path], Run]:
    """A reference_run launcher: this machine, one process (None) or `nproc` torchrun ranks."""
    return lambda overrides, workdir: train(overrides, nproc=nproc)


@dataclass
class Run:
    returncode: int
    output: str
    output_dir: Path | None = None


def trainer_command(overrides: list[str], nproc: int | None, command: str = "train",
                    config: str | None = None, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m trainer ...` as a plain process (nproc None) or under torchrun."""
    program = trainer_program(command, config, overrides)
    if nproc is None:
        return [PYTHON, *program]
    return torchrun_argv(nproc, program, torchrun_args=torchrun_args)


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO) -> Run:
    """Run to completion in its own process group; everything it started is killed on
    timeout or error."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**BASE_ENV, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{output[-4000:]}")
    finally:
        kill_tree(proc)
    return Run(proc.returncode, output)


_idle_servers: queue.SimpleQueue[preloaded.Server] = queue.SimpleQueue()


_servers: list[preloaded.Server] = []
"""tests/preloaded.py's servers: each serves one run at a time, and a run that finds none idle
starts one (together() runs 2 or 3 at once)."""


IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH_", "ATEN_", "ONEDNN_",
                   "DNNL_", "XDG_", "OMP_", "MKL_", "PYTHON")
"""What the interpreter and the libraries read once, at start or import (ATEN_CPU_CAPABILITY,
say): a run that sets any of it needs an interpreter of its own, not a preloaded one."""


PRELOADED_MODULES = ("trainer", "trainer.cli.torchrun")


def run_preloaded(module: str, args: list[str], env: dict | None = None, timeout: float = 300) -> Run:
    """`python -m MODULE ARGS` as a process forked from a tests/preloaded.py server, which
    imported torch, transformers and datasets once: the same entry point, in a process and
    session of its own, without the 3-4 s of imports a fresh interpreter pays."""
    try:
        server = _idle_servers.get_nowait()
    except queue.Empty:
        server = preloaded.Server(PYTHON, BASE_ENV, REPO)
        _servers.append(server)
    code, output, timed_out = server.run(module, args, env or {}, REPO, timeout)
    _idle_servers.put(server)  # not after an interrupted run, whose reply it may still owe
    if timed_out:
        pytest.fail(f"timed out after {timeout}s: python -m {module} {' '.join(args)}\n{output[-4000:]}")
    return Run(code, output)


def launch(cmd: list[str], env: dict | None = None, timeout: float = 300) -> Run:
    """`run(cmd)`; `python -m trainer` (the 1 process that 2 ranks must equal) and
    `python -m trainer.cli.torchrun` forked from a preloaded server instead, unless the environment
    sets what is read at import. torchrun's workers are forked from it too (tests/preloaded.py);
    TESTS_FORKED_RANKS=0 in pytest's environment starts them as fresh interpreters, as a user's
    are, for a run of the e2e tier that shows the two ways agree."""
    env = env or {}
    if (cmd[:2] == [PYTHON, "-m"] and cmd[2] in PRELOADED_MODULES
            and not any(key.startswith(IMPORT_TIME_ENV) for key in env)):
        if cmd[2] == "trainer.cli.torchrun" or cmd[3:4] == ["sweep"]:
            env = {preloaded.FORKED_RANKS_ENV: os.environ.get(preloaded.FORKED_RANKS_ENV, "1"), **env}
        return run_preloaded(cmd[2], cmd[3:], env, timeout)
    return run(cmd, timeout=timeout, env=env)


def assert_usage_error(result: Run, expected: str) -> None:
    """The CLI's contract for a usage error: exit code 2, one `error: ` line and it says
    `expected`, no traceback."""
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.output[-3000:]
    assert len(errors) == 1 and expected in errors[0], result.output[-3000:]
    assert "Traceback" not in result.output


def previous_run(out: Path) -> dict[str, str]:
    """An output_dir holding an earlier run's files; returns their checksums."""
    for name, text in {"metrics.jsonl": '{"step": 2}\n', "summary.json": "{}", "config.yaml": "seed: 0\n",
                       "checkpoints/step-2/COMPLETE": "{}", "final/config.json": "{}"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return snapshot(out)


def snapshot(out: Path) -> dict[str, str]:
    """The checksum of every file under `out`, by relative path: equal before and after a
    run that wrote nothing."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def train(overrides: list[str], nproc: int | None = 2, **kwargs) -> Run:
    result = launch(trainer_command(overrides, nproc), **kwargs)
    assert result.returncode == 0, failure_output(result.output)
    return result


def together(*launches: tuple[list[str], dict]) -> list[Run]:
    """Independent launches, each (command, environment), run at once, their results in order:
    a reference and the runs compared with it spend most of their seconds importing and
    loading, which overlap. Nothing here is timed, so sharing the cores changes no result."""
    with ThreadPoolExecutor(len(launches)) as pool:
        return list(pool.map(lambda command_env: launch(*command_env), launches))


def train_together(*launches: tuple[list[str], int | None]) -> list[Run]:
    """Independent trainings, each (overrides, nproc), run at once (`together`); each must succeed."""
    results = together(*((trainer_command(overrides, nproc), {}) for overrides, nproc in launches))
    for result in results:
        assert result.returncode == 0, failure_output(result.output)
    return results


def failure_output(output: str, tail: int = 6000) -> str:
    """A failed run's output for the assertion message: its tail, after the first watchdog
    report or native crash (faulthandler's "Fatal Python error", a rank's SIGABRT or SIGSEGV)
    if there is one earlier. The tail shows the peers' collective timeouts; the rank they
    waited for, stalled or crashed elsewhere, is explained only by its report and stacks."""
    found = [at for at in (output.find(": stalled in "), output.find("Fatal Python error")) if at >= 0]
    report = min(found, default=-1)
    if report < 0 or report >= len(output) - tail:
        return output[-tail:]
    start = output.rfind("\n", 0, report) + 1
    return f"{output[start:start + tail]}\n[...]\n{output[-tail:]}"


def kill_then_resume(overrides: list[str], output_dir: Path, faults: dict[str, str], resumed_from: int,
                     beside: tuple[tuple[list[str], int | None], ...] = ()) -> Run:
    """Launch 2 ranks with `faults` (a TRAINER_FAULT_SIGKILL among them), which must kill the
    run, then relaunch without: the relaunch must resume from checkpoint `resumed_from` and
    finish. `beside`: trainings, each (overrides, nproc), that run at once with the killed one
    and must succeed (the uninterrupted run it is compared with). Returns the relaunch."""
    killed, *others = together((trainer_command(overrides, nproc=2), faults),
                               *((trainer_command(o, nproc), {}) for o, nproc in beside))
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    for other in others:
        assert other.returncode == 0, failure_output(other.output)
    resumed = train(overrides)
    assert f"resumed from {output_dir / 'checkpoints' / f'step-{resumed_from}'}" in resumed.output
    return resumed


def close_preloaded_servers() -> None:
    """At the session's end: each server's last run has ended."""
    for server in _servers:
        server.close()
