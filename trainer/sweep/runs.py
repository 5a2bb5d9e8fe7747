"""A sweep's runs: each an ordinary trainer run in output_dir/trials/<id>/, launched as its own
torchrun (trainer/runtime/launch.py) with the sweep's config and the run's overrides (its setting, its
seed, its fold), in the sweep's process group: a scheduler that kills the sweep kills them.

A run is finished when its summary.json exists (and, with folds, its out-of-fold rows): a
restarted sweep reads it and does not train again. An unfinished run is launched again into
the same folder, where the trainer resumes from its newest checkpoint, as any run does.

A preemption signal sent to the sweep's process alone (Kubernetes signals a container's first
process; `sbatch --signal=B:...` the batch shell, which execs the sweep) is passed on to every
run it launched, which saves and exits 75; no run starts after it, and the sweep exits 75 once
they have all ended (`passing_on`). Without that, the runs would train on with no sweep, and
hold their folders' leases against the sweep started again.

With sweep.pruner, the sweep reads each run's metrics.jsonl while it waits on it and feeds its
evaluations to the setting's judge (trainer/sweep/pruning.py); a run of a pruned setting gets
the same signal, alone, saves and exits 75, and that is no failure.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import exit_codes
from trainer.errors import ConfigError, TrainerError
from trainer.exit_codes import Exit
from trainer.runtime import launch
from trainer.sweep import preload, pruning
from trainer.sweep.search_space import Scalar, override

log = logging.getLogger(__name__)

TRIALS = "trials"


class RunFailed(TrainerError):
    """A run of the sweep exited non-zero: the sweep stops with its exit code (75, a
    preemption, asks the launcher to requeue the whole sweep, which resumes it)."""

    def __init__(self, message: str, exit_code: int):
        """`exit_code`: the run's, as a verdict (trainer/exit_codes.py)."""
        super().__init__(message)
        self.exit_code = exit_codes.of(exit_code)


@dataclass(frozen=True)
class Run:
    setting_number: int
    setting: dict[str, Scalar]
    seed: int
    fold: int | None
    folds: int | None
    name: str | None = None
    """A folder name of its own (the refit), instead of setting, seed and fold."""

    @property
    def id(self) -> str:
        if self.name is not None:
            return self.name
        return f"{self.setting_number:03d}-seed{self.seed}" + ("" if self.fold is None else f"-fold{self.fold}")

    def overrides(self, folder: Path) -> list[str]:
        folds = [] if self.fold is None else [override("data.folds", self.folds), override("data.fold", self.fold)]
        return [*(override(k, v) for k, v in self.setting.items()), override("seed", self.seed), *folds,
                override("output_dir", str(folder))]


def runs_of(setting_number: int, setting: dict[str, Scalar], first_seed: int, seeds: int,
            folds: int | None) -> list[Run]:
    """A setting's runs: each seed, and with folds each fold of each seed."""
    return [Run(setting_number, setting, first_seed + s, fold, folds)
            for s in range(seeds) for fold in ([None] if folds is None else range(folds))]


def rows_file(folder: Path) -> Path | None:
    """The out-of-fold rows `evaluate` wrote into the run's final/ (eval-SPLIT-rows.csv)."""
    found = sorted((folder / "final").glob("eval-*-rows.csv"))
    return found[0] if found else None


def finished(folder: Path, needs_rows: bool) -> dict[str, Any] | None:
    """The run's summary.json if it ran to the end (and its rows, where they are needed)."""
    summary = folder / "summary.json"
    if not summary.is_file() or (needs_rows and rows_file(folder) is None):
        return None
    return json.loads(summary.read_text())


@dataclass
class Slots:
    """Where the runs side by side go: `parallel` slots, each `nproc` ranks, on CPU or on
    its share of the GPUs (CUDA_VISIBLE_DEVICES)."""

    parallel: int
    nproc: int
    gpus: list[str]
    extra: tuple[str, ...] = ()
    """Overrides every run gets from the sweep (train.threads on CPU)."""

    def __post_init__(self) -> None:
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.parallel):
            self._free.put(slot)

    @classmethod
    def plan(cls, parallel: int, ranks: int | None, threads_set: bool) -> Slots:
        """sweep.parallel slots sharing sweep.ranks (null: the GPUs, or one rank per slot)."""
        gpus = _visible_gpus()
        total = ranks or len(gpus) or parallel
        nproc = total // parallel
        if nproc < 1:
            raise ConfigError(f"sweep.parallel: {parallel} trials at once need {parallel} ranks or more, and "
                              f"the GPUs give {total}")
        extra: tuple[str, ...] = ()
        if not gpus and not threads_set:  # the node's cores split between every rank of every slot
            extra = (override("train.threads", max(1, len(os.sched_getaffinity(0)) // total)),)
        return cls(parallel, nproc, gpus, extra)

    @contextmanager
    def take(self) -> Iterator[dict[str, str]]:
        """A free slot for a run: the environment that places it."""
        slot = self._free.get()
        try:
            env = dict(os.environ)
            if self.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[slot * self.nproc:(slot + 1) * self.nproc])
            yield env
        finally:
            self._free.put(slot)


def _visible_gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return names[:torch.cuda.device_count()]


def execute(run: Run, trials_dir: Path, config_file: Path, slots: Slots, judge: pruning.Judge | None = None,
            preloaded: preload.Preloaded | None = None) -> dict[str, Any] | None:
    """The run's summary: read where it finished before, else trained (resuming from its
    checkpoints) and, with folds, its validation fold's rows written by `evaluate`. With a
    `judge` (sweep.pruner), its evaluations are fed to it as they are written; None when the
    judge pruned its setting: the run was stopped (it saved, exit 75), or not started. With
    `preloaded` (sweep.preload), a one-rank run is one process forked from it, not torchrun."""
    folder = trials_dir / run.id
    done = finished(folder, needs_rows=run.fold is not None)
    if done is not None:
        log.info("trial %s: finished before, not run again", run.id)
        if judge is not None:  # its evaluations count as those of a run just ended
            judge.seen(run.id, pruning.Records(folder).new(), ended=True)
        return done
    overrides = [*run.overrides(folder), *slots.extra]
    with slots.take() as env:
        if judge is not None and judge.pruned:
            return None  # its setting was pruned while it waited for a slot
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "summary.json").is_file():
            log.info("trial %s: training (%s)", run.id, " ".join(overrides[:-1 - len(slots.extra)]) or "defaults")
            program = launch.trainer_program("train", str(config_file), overrides)
            # One rank needs no launcher: the run is the process, as `python -m trainer train` is.
            argv = [sys.executable, *program] if preloaded is not None and slots.nproc == 1 else launch.torchrun_argv(
                slots.nproc, program)
            _launch(argv, env, folder / "trial.log", run.id, _Following(judge, run.id, folder) if judge else None,
                    preloaded)
        elif judge is not None:  # trained, not yet evaluated on its fold
            judge.seen(run.id, pruning.Records(folder).new(), ended=True)
        if judge is not None and judge.pruned:
            return None  # stopped, or ended before the signal came: its setting has no use for its rows
        if run.fold is not None:  # its validation fold's rows, each with the model's answer
            argv = [sys.executable, *launch.trainer_program("evaluate", str(config_file),
                                                            [*overrides, "checkpoint=final"])]
            _launch(argv, env, folder / "evaluate.log", run.id, preloaded=preloaded)
    summary = json.loads((folder / "summary.json").read_text())
    log.info("trial %s: finished: validation %s", run.id,
             ", ".join(f"{k} {v:.4f}" for k, v in summary["final_eval"].items() if isinstance(v, float)))
    return summary


@dataclass
class _Following:
    """A run's metrics.jsonl read while the sweep waits on its training, fed to its setting's judge."""

    judge: pruning.Judge
    run_id: str
    folder: Path

    def __post_init__(self) -> None:
        self.records = pruning.Records(self.folder)

    def read(self, ended: bool = False) -> bool:
        """The records written since the last read fed to the judge; whether the setting is pruned."""
        self.judge.seen(self.run_id, self.records.new(), ended)
        return self.judge.pruned


class _Launched:
    """The runs' processes alive now (each run's torchrun, or its evaluate), and the signal
    that stops the sweep, once one has come."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen | preload.Run] = set()
        self.stopped_by: str | None = None

    @contextmanager
    def start(self, argv: list[str], env: dict[str, str], out, run_id: str,
              preloaded: preload.Preloaded | None = None) -> Iterator[subprocess.Popen | preload.Run]:
        with self._lock:  # the signal handler takes it too: no run starts after it has passed the signal on
            if self.stopped_by is not None:
                raise RunFailed(f"trial {run_id}: not started: the sweep was stopped by {self.stopped_by}",
                                Exit.PREEMPTED)
            proc: subprocess.Popen | preload.Run | None = None
            # The zygote's first fork waits for its imports (seconds), under this lock: a signal
            # meanwhile is passed on once the run has started, as to any run alive.
            if preloaded is not None and preload.forkable(argv):
                try:
                    proc = preloaded.start(argv, env, out)
                    log.info("trial %s: %s forked, preloaded (pid %d)", run_id, argv[3], proc.pid)
                except preload.Refused as e:
                    log.warning("trial %s: started afresh, not preloaded: %s", run_id, e)
            if proc is None:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            self._running.add(proc)
        try:
            yield proc
        finally:
            with self._lock:
                self._running.discard(proc)

    def stop_one(self, proc: subprocess.Popen | preload.Run, signum: int) -> None:
        """`signum` to one run (its setting pruned), if it is still alive; the others go on."""
        with self._lock:
            if proc in self._running and proc.poll() is None:
                proc.send_signal(signum)  # torchrun passes it to its workers, which save and exit 75

    def stop(self, signum: int) -> None:
        """`signum` to every run alive, and none started after it."""
        with self._lock:
            self.stopped_by = self.stopped_by or signal.Signals(signum).name
            for proc in self._running:
                proc.send_signal(signum)  # torchrun passes it to its workers, which save and exit 75


_launched = _Launched()


@contextmanager
def passing_on(signal_names: list[str]) -> Iterator[None]:
    """While the sweep runs its runs: each of `signal_names` (fault.preempt_signals) that the
    sweep's process receives is passed on to every run alive, and no run starts after it."""
    def on_signal(signum: int, frame) -> None:
        threading.Thread(target=_launched.stop, args=(signum,), daemon=True).start()  # not under a held lock

    previous = {name: signal.signal(getattr(signal, name), on_signal) for name in signal_names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


FOLLOW_S = 0.25
"""How often the sweep reads a followed run's new evaluations while it waits on the run."""


def _launch(argv: list[str], env: dict[str, str], log_file: Path, run_id: str,
            following: _Following | None = None, preloaded: preload.Preloaded | None = None) -> None:
    with log_file.open("a") as out, _launched.start(argv, env, out, run_id, preloaded) as proc:
        if following is None:
            code = proc.wait()
        else:
            # Cannot hang where a plain wait() would not: each wait returns within FOLLOW_S, a
            # read of a regular file does not block, and the loop ends when the process does.
            signalled = False
            while True:
                try:
                    code = proc.wait(timeout=FOLLOW_S)
                    break
                except subprocess.TimeoutExpired:
                    if following.read() and not signalled:
                        signalled = True
                        _launched.stop_one(proc, following.judge.stop_signal)
            following.read(ended=code == 0)  # what it wrote last, its final evaluation among them
    # Stopped by its signal, a run exits 75 once it has saved, or under torchrun 128 + the signal
    # once its workers have (trainer/cli/torchrun.py); a run that ended before the signal came exits 0.
    if (following is not None and following.judge.pruned and _launched.stopped_by is None
            and code in (0, Exit.PREEMPTED, 128 + following.judge.stop_signal)):
        log.info("trial %s: stopped, its setting pruned (exit %d); its checkpoints stay in its folder", run_id, code)
        return
    if code != 0 and _launched.stopped_by is not None:
        raise RunFailed(f"trial {run_id}: stopped by {_launched.stopped_by} (exit {code}); its log: {log_file}",
                        Exit.PREEMPTED)
    if code != 0:
        raise RunFailed(f"trial {run_id}: exited with {code}; its log: {log_file}", code)
