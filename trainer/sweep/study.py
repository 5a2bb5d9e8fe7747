"""The Optuna study behind a sweep: its sampler and pruner from sweep.method and sweep.pruner,
kept in a journal file under output_dir (JournalFileBackend: appended records, no server, so
the processes of a sweep on many nodes of one file system share it), and what a restart does
with the trials a killed sweep left running.

An Optuna trial is a setting; its runs (seeds x folds) are trainer runs (trainer/sweep/runs.py).
A setting keeps the number of its first trial across restarts (`first_trial_number`), which
names its runs' folders (on a grid, its place in the grid does: search_space.Space.place), so a
retried setting finds its finished runs and its runs' checkpoints.
Only Optuna's public API is used: the study, its trials and the retry callback.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.storages import JournalStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from trainer.sweep.search_space import Space

JOURNAL = "sweep-journal.log"
STUDY = "sweep"


@contextmanager
def quiet() -> Iterator[None]:
    """While the sweep runs: Optuna's own log at ERROR, its level before restored after. A
    trial whose run failed is the sweep's one `error:` line (runs.RunFailed); Optuna would log
    it again at WARNING, with its traceback. And its ExperimentalWarning silenced: the retry
    callback's accessors (`retry_history`, `retried_trial_number`) are marked experimental."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def journal(output_dir: Path) -> JournalStorage:
    """The storage of the sweep's study: output_dir/sweep-journal.log."""
    return JournalStorage(JournalFileBackend(str(output_dir / JOURNAL)))


def open_study(output_dir: Path, space: Space, method: str, direction: str, seed: int, pruner: str,
               eval_every: int | str = 0) -> optuna.Study:
    """The sweep's study in output_dir/sweep-journal.log, created or loaded. With pruner
    halving, the trials report at the steps their runs evaluate (`eval_every`, a step count:
    plan.check), and the first rung is the first evaluation."""
    storage = journal(output_dir)
    # A sampler's random state is not in the journal: a restart seeds it past the trials
    # already asked, so random sampling does not ask again what it asked before the kill.
    existing = (optuna.load_study(study_name=STUDY, storage=storage).trials
                if STUDY in optuna.get_all_study_names(storage) else [])
    sampler: optuna.samplers.BaseSampler
    if method == "grid":
        sampler = OneAtATimeGridSampler(space.grid(), seed=seed)
    elif method == "random":
        sampler = optuna.samplers.RandomSampler(seed=seed + len(existing))
    else:
        sampler = optuna.samplers.TPESampler(seed=seed + len(existing))
    pruning: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if pruner == "halving":
        # Rungs at min_resource x 4^k steps: each is judged at the first evaluation at or past it
        # (Optuna compares a trial's value at its latest reported step), the first at the first
        # evaluation. Its default "auto" would wait for a complete setting and then put the first
        # rung at 1/100 of its steps, between evaluations. reduction_factor stays Optuna's 4: at
        # each rung about a quarter of the settings go on, and below 4 settings at a rung only one
        # as good as every setting before it there.
        assert isinstance(eval_every, int) and eval_every > 0, "plan.check: halving needs train.eval_every steps"
        pruning = optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_every)
    return optuna.create_study(study_name=STUDY, storage=storage, sampler=sampler, pruner=pruning,
                               direction="maximize" if direction == "max" else "minimize", load_if_exists=True)


class OneAtATimeGridSampler(optuna.samplers.GridSampler):
    """Optuna's GridSampler, whose trials take their grid points one at a time.

    A trial numbered past the grid's size (on a restart: the retries took numbers) is given a
    point not yet finished nor running, drawn at random, and written to the trial as it is given.
    The sweep asks for `sweep.parallel` trials at once from threads of one process: two asked
    together could draw the same point before either wrote it, and then one setting ran twice
    and another never. Across processes the sweep has one driver (`retry_unfinished`)."""

    def __init__(self, search_space, seed: int) -> None:
        super().__init__(search_space, seed=seed)
        self._choosing = threading.Lock()

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        with self._choosing:
            super().before_trial(study, trial)


def retry_unfinished(output_dir: Path) -> list[int]:
    """Each trial a killed sweep left RUNNING, and each FAILED one not retried yet, asked
    again: marked failed (`Study.tell`) and enqueued with its parameters by Optuna's own retry
    callback (RetryHeartbeatStaleTrialCallback), which keeps its grid point and its first number.
    Only the sweep's one driver calls this, at its start, once `open_study` has made the study:
    a trial still RUNNING then has no process. Returns the settings asked again.

    Done through a study of its own on the journal, whose sampler does nothing as a trial ends:
    `tell` calls the sampler's `after_trial`, and the sweep's GridSampler there stops the study
    once no grid point is left unfinished, which raises outside `optimize`."""
    journal_study = optuna.load_study(study_name=STUDY, storage=journal(output_dir),
                                      sampler=optuna.samplers.RandomSampler())
    trials = journal_study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}
    retry = RetryHeartbeatStaleTrialCallback()
    again = []
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            journal_study.tell(trial.number, state=TrialState.FAIL)
        elif not (trial.state == TrialState.FAIL and trial.number not in retried):
            continue
        retry(journal_study, trial)  # its parameters and attributes, which failing it left as they were
        again.append(first_trial_number(trial))
    return again


def first_trial_number(trial: FrozenTrial | optuna.Trial) -> int:
    """The number of the setting's first trial: its retries keep it."""
    frozen = trial if isinstance(trial, FrozenTrial) else _frozen(trial)
    first = RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
    return frozen.number if first is None else first


def _frozen(trial: optuna.Trial) -> FrozenTrial:
    """A running trial as its study holds it, with the system attributes a Trial does not show."""
    return next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)


def settled(study: optuna.Study) -> list[FrozenTrial]:
    """The settings tried to the end: complete, or pruned."""
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
