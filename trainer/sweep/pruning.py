"""sweep.pruner=halving on the evaluations a run already makes: each run of a setting logs
`eval/<metric>` at every train.eval_every steps into its metrics.jsonl (trainer/train/loop.py
`_validate`, trainer/train/tracking.py); the sweep reads those files as they grow, and once every
run of the setting has evaluated at step s, reports their mean at s to the setting's Optuna
trial and asks its pruner (successive halving: trainer/sweep/study.py) whether to go on.

What is reported depends only on what the runs wrote, never on when the sweep read it, so a
sweep started again, reading back the runs that finished and following those it resumes
(which redo their steps bit for bit), reports the same means at the same steps, and its
pruner decides the same.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any, Protocol

from trainer import files

METRICS_FILE = "metrics.jsonl"


class Records:
    """A run's metrics.jsonl followed as it grows: each call of `new()` gives the records
    written since the last. A resumed run rewrites the file first (it drops the records after
    its checkpoint: trainer/train/tracking.py, replaced whole by a rename); it is then read again from
    its start, and the steps it redoes are written again with the same values. The file is the
    trainer's own, not Optuna's journal (which the sweep reads only through its study): no
    library reads it, and a file replaced by a rename is told apart by its inode."""

    def __init__(self, folder: Path):
        self.path = folder / METRICS_FILE
        self._inode: int | None = None
        self._offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:  # another file at the path: a resume rewrote it
                    self._inode, self._offset = inode, 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # the run has not logged yet
            return []
        whole = data.rfind(b"\n") + 1  # a line being written is read once it is whole
        self._offset += whole
        return [json.loads(line) for line in data[:whole].splitlines() if line.strip()]


def evaluations(folder: Path, metric: str) -> dict[int, float]:
    """A run's validation `metric` by step, from its metrics.jsonl as it is now."""
    key = f"eval/{metric}"
    return {int(r["step"]): float(r[key]) for r in files.read_jsonl(folder / METRICS_FILE) if key in r}


class Trial(Protocol):
    """What the judge needs of an Optuna trial."""

    def report(self, value: float, step: int) -> None: ...

    def should_prune(self) -> bool: ...


class Judge:
    """A setting's runs' evaluations, fed by the threads that wait on its runs, reported to
    its trial step by step: the mean at step s once every run has evaluated at s, and has
    either logged a later step or ended (a run whose last evaluation is s, stopped early, does
    not hold the others). The pruner is asked only where some run has gone on past s: a step
    that is every run's last stops nothing, and a setting whose runs are all done is complete.

    Both conditions are facts of the runs' files (a step logged, a run ended), the same however
    the sweep read them and however its threads interleave: the reports and the verdict are
    the same in a sweep started again."""

    def __init__(self, run_ids: list[str], metric: str, trial: Trial, stop_signal: int = signal.SIGTERM):
        self.metric = metric
        self.stop_signal = stop_signal
        """What stops a run of a pruned setting: the first of fault.preempt_signals, on which
        it saves and exits 75."""
        self._trial = trial
        self._values: dict[str, dict[int, float]] = {run: {} for run in run_ids}
        self._latest: dict[str, int] = dict.fromkeys(run_ids, -1)
        self._ended: set[str] = set()
        self._reported = -1
        self._lock = threading.Lock()  # the runs' threads feed it at once; a trial is asked in order
        self.pruned_at: int | None = None
        """The step at which the pruner stopped the setting, or None."""
        self.mean: float = math.nan
        """The mean last reported."""

    def seen(self, run_id: str, records: list[dict[str, Any]], ended: bool = False) -> None:
        """`records`: lines of the run's metrics.jsonl not seen before; `ended`: the run's
        training has exited (finished, or read back finished)."""
        key = f"eval/{self.metric}"
        with self._lock:
            for record in records:
                step = int(record["step"])
                self._latest[run_id] = max(self._latest[run_id], step)
                if key in record:
                    self._values[run_id][step] = float(record[key])
            if ended:
                self._ended.add(run_id)
            self._report()

    def _report(self) -> None:
        runs = list(self._values)
        common = set.intersection(*(set(self._values[r]) for r in runs))
        for step in sorted(s for s in common if s > self._reported):
            if self.pruned_at is not None:
                return
            if not all(self._latest[r] > step or r in self._ended for r in runs):
                return  # until each run has gone on past s or ended, s may be every run's last: wait
            self._reported = step
            self.mean = math.fsum(self._values[r][step] for r in runs) / len(runs)
            self._trial.report(self.mean, step)
            if any(self._latest[r] > step for r in runs) and self._trial.should_prune():
                self.pruned_at = step

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None
