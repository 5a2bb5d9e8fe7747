"""The preemption grace budget: the seconds a stopped job has to save, and whether they suffice.

A preempted job is told to stop (SIGTERM, or Slurm's time-limit signal) and killed some
seconds later. In between, every rank finishes its step, agrees to stop, and saves a
checkpoint (trainer/faults/preemption.py); what is not saved by the kill is lost. Two clocks run:
the launcher's (Slurm's --signal lead, Kubernetes' terminationGracePeriodSeconds, compose's
stop_grace_period), which it states in TRAINER_GRACE_S, and torchrun's own: it SIGKILLs its
workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after it forwards the signal,
however long the launcher would wait. `python -m trainer doctor` times this model's save on
output_dir's storage, with the run's own checkpointer, and checks it against the shorter of the two.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import loading
from trainer.config.schema import Config
from trainer.data.batch_plan import BatchPlan
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:
    from trainer.data.loaders import Data
    from trainer.train.build import Built

GRACE_ENV = "TRAINER_GRACE_S"
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_SHUTDOWN_S = 30.0
"""torchrun's default for TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
LAUNCHER_MARGIN_S = 30.0
"""What a launcher's grace may exceed torchrun's shutdown timeout by without a warning: the
time for torchrun to kill its workers and exit, and for the launcher to act on its code
(the manifests and compose leave 10 s; slurm/ddp.sh up to 30 s, to requeue the job)."""


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    try:
        return float(environ[name])
    except (KeyError, ValueError):
        return None


def time_save(cfg: Config, dist_env: DistEnv, built: Built, run_data: Data, folder: Path) -> float:
    """Collective: seconds to save the run's state as a stop saves it: the run's own
    Checkpointer, in its strategy's format, written and flushed to the disk in `folder` (on
    output_dir's storage), rank 0's time; every rank takes part, as it would. The folder is
    removed after."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.faults.numerics import BadSteps
    from trainer.train.policy import Selection
    from trainer.train.state import TrainState

    batch = BatchPlan.of(cfg.train, dist_env.world_size)
    train_state = TrainState(batch, run_data, Selection.from_config(cfg), dist_env, "doctor", run_data.labels,
                             BadSteps(cfg.fault.max_bad_steps))
    checkpointer = Checkpointer(str(folder), keep=1, dist_env=dist_env,
                                checkpoint_format=built.strategy.checkpoint_format)
    started = time.perf_counter()
    try:
        checkpointer.save(0, built.states(train_state), loading.to_yaml(cfg))
    finally:
        seconds = time.perf_counter() - started
        distributed.rank_zero_does(dist_env, f"{folder}", lambda: shutil.rmtree(folder, ignore_errors=True))
    return distributed.broadcast_from_rank_zero(dist_env, seconds)


def check(step_s: float, save_s: float, environ: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """(the report's lines, warnings) for a job whose step takes `step_s` and save `save_s`."""
    grace = _seconds(environ, GRACE_ENV)
    shutdown = _seconds(environ, SHUTDOWN_ENV) or TORCHRUN_SHUTDOWN_S
    budget = min(shutdown, grace) if grace is not None else shutdown
    need = step_s + save_s
    launcher = f"{GRACE_ENV}={grace:g}s" if grace is not None else f"the launcher's unknown ({GRACE_ENV} unset)"
    lines = [(f"preemption grace: {budget:.0f}s from the stop signal to SIGKILL: the shorter of {launcher} and "
             f"torchrun's {SHUTDOWN_ENV}={shutdown:g}s"),
             (f"  a stop needs ~{need:.1f}s: the step under way (~{step_s:.1f}s of compute), then a save of the "
             f"model and optimizer ({save_s:.1f}s measured on output_dir's storage)")]
    warnings = []
    if need > budget:
        warnings.append(f"preemption: stopping needs ~{need:.0f}s but the job has {budget:.0f}s, so a preempted "
                        "job loses the steps since its last checkpoint: give it more grace (docs/restarts.md, "
                        "\"Grace\")")
    if grace is not None and grace > shutdown + LAUNCHER_MARGIN_S:
        warnings.append(f"{GRACE_ENV}={grace:g}s, but torchrun kills its workers {shutdown:g}s after the signal: "
                        f"set {SHUTDOWN_ENV} a few seconds below the launcher's grace")
    return lines, warnings
