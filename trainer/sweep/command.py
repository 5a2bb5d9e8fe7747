"""`python -m trainer sweep -c CONFIG [key=value ...]`: the sweep.section of the config run as
an Optuna study whose trials are ordinary runs; what it checks before any trial, how it
places and resumes them, and what it leaves in output_dir (docs/sweeps.md)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from trainer import exit_codes, files
from trainer.config import loading
from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainer.sweep import preload, pruning, results, runs, study
from trainer.sweep.plan import Plan, check_same_sweep

log = logging.getLogger("trainer.sweep")

CONFIG_FILE = "sweep.yaml"
"""The sweep's config as loaded (file and overrides), which every trial is launched with."""


def write_config(cfg: Config) -> Path:
    """output_dir/sweep.yaml: the config as the sweep loaded it, which every run is launched with."""
    config_file = Path(cfg.output_dir) / CONFIG_FILE
    config_file.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(config_file, loading.to_yaml(cfg))
    return config_file


def array_runs(cfg: Config, plan: Plan) -> tuple[Path, list[runs.Run]]:
    """A job array's tasks (slurm/submit.py --sweep): every run of the grid, in grid order,
    each named as `run` names it, and the config file they are launched with. After the array,
    `python -m trainer sweep` with the same config finds them finished and reports (with
    folds, it first evaluates each fold's run on its fold)."""
    if cfg.sweep.method != "grid":
        raise ConfigError(f"sweep.method: a job array runs a grid; {cfg.sweep.method} asks Optuna for each "
                          "setting as the last ones end: run `python -m trainer sweep` instead")
    grid_runs = [setting_run for number, setting in enumerate(plan.space.settings())
                 for setting_run in runs.runs_of(number, setting, cfg.seed, cfg.sweep.seeds, cfg.sweep.folds)]
    check_same_sweep(Path(cfg.output_dir) / CONFIG_FILE, cfg)
    return write_config(cfg), grid_runs


def run(cfg: Config, plan: Plan) -> int:
    """Every setting's runs to the end (those finished before read, not run again), then the
    results. Returns 0; a preemption signal (fault.preempt_signals) stops it with RunFailed,
    exit 75, once every run alive has saved and ended."""
    # The zygote starts with the first run it forks (one of one rank, or a fold's evaluation), if any.
    with study.quiet(), preload.zygote(cfg.sweep.preload) as preloaded:
        return _run(cfg, plan, preloaded)


def _run(cfg: Config, plan: Plan, preloaded: preload.Preloaded | None) -> int:
    out = Path(cfg.output_dir)
    sweep = cfg.sweep
    check_same_sweep(out / CONFIG_FILE, cfg)
    config_file = write_config(cfg)
    trials_dir = out / runs.TRIALS
    slots = runs.Slots.plan(sweep.parallel, sweep.ranks, cfg.train.threads is not None)
    optuna_study = study.open_study(out, plan.space, sweep.method, plan.direction, cfg.seed, sweep.pruner,
                                    cfg.train.eval_every)
    again = study.retry_unfinished(out)
    if again:
        log.info("sweep: settings %s were cut short: running them again, their runs resumed", again)
    settled = study.settled(optuna_study)
    # Told to the study before a stop: their runs are not looked at again.
    for number, trial in sorted(((setting_number(cfg, plan, t, t.params), t) for t in settled), key=lambda p: p[0]):
        log.info("sweep: setting %d %s before, not run again", number,
                 "pruned" if trial.state == optuna.trial.TrialState.PRUNED else "finished")
    remaining = plan.settings - len(settled)
    log.info("sweep: %d settings x %d seeds%s by %s, %d left, %d at a time on %d rank(s) each", plan.settings,
             sweep.seeds, f" x {sweep.folds} folds" if sweep.folds else "", plan.metric, remaining,
             sweep.parallel, slots.nproc)

    failed: list[runs.RunFailed] = []

    def objective(trial) -> float:
        try:
            return setting_value(trial)
        except runs.RunFailed as e:
            failed.append(e)
            raise

    def setting_value(trial) -> float:
        setting = plan.space.suggest(trial)
        number = setting_number(cfg, plan, trial, setting)
        setting_runs = runs.runs_of(number, setting, cfg.seed, sweep.seeds, sweep.folds)
        judge = None
        if sweep.pruner == "halving":  # judged on its runs' evaluations as they are written
            stop_signal = getattr(signal, next(iter(cfg.fault.preempt_signals), "SIGTERM"))
            judge = pruning.Judge([r.id for r in setting_runs], plan.metric, trial, stop_signal)
        with ThreadPoolExecutor(max_workers=sweep.parallel) as pool:  # side by side, as slots free up
            summaries = list(pool.map(lambda r: runs.execute(r, trials_dir, config_file, slots, judge, preloaded),
                                      setting_runs))
        if judge is not None and judge.pruned:
            log.info("sweep: setting %d (%s) pruned at step %d (%s %.4f, the mean of its %d runs there)", number,
                     setting, judge.pruned_at, plan.metric, judge.mean, len(setting_runs))
            raise optuna.TrialPruned
        return float(np.mean([s["final_eval"][plan.metric] for s in summaries if s is not None]))

    with runs.passing_on(list(cfg.fault.preempt_signals)):  # to the runs, which save: the sweep then exits 75
        if remaining > 0:
            with contextlib.suppress(runs.RunFailed):  # each one is in `failed`
                optuna_study.optimize(objective, n_trials=remaining, n_jobs=sweep.parallel)
        if failed:  # Optuna raises a trial's error only when another is due: the last ones' it drops
            verdict = exit_codes.worst(e.exit_code for e in failed)
            raise next(e for e in failed if e.exit_code == verdict)
        return report(cfg, plan, optuna_study, config_file, slots, preloaded)


def setting_number(cfg: Config, plan: Plan, trial: Any, setting: dict) -> int:
    """What names a setting's runs' folders: on a grid, its place in the grid (the same folders
    however the sweep ran, or was killed and started again); else its first trial's number."""
    if cfg.sweep.method == "grid":
        return plan.space.place(setting)
    return study.first_trial_number(trial)


def report(cfg: Config, plan: Plan, optuna_study: optuna.Study, config_file: Path, slots: runs.Slots,
           preloaded: preload.Preloaded | None = None) -> int:
    out, sweep = Path(cfg.output_dir), cfg.sweep
    settings = []
    for trial in study.settled(optuna_study):
        number = setting_number(cfg, plan, trial, dict(trial.params))
        done, stopped = [], []
        pruned_at = trial.last_step if trial.state == TrialState.PRUNED else None
        for setting_run in runs.runs_of(number, dict(trial.params), cfg.seed, sweep.seeds, sweep.folds):
            folder = out / runs.TRIALS / setting_run.id
            summary = runs.finished(folder, needs_rows=setting_run.fold is not None)
            if summary is not None:
                done.append((setting_run, summary))
            elif pruned_at is not None:  # stopped: its evaluation where the pruner judged it
                stopped.append((setting_run, pruning.evaluations(folder, plan.metric).get(pruned_at, math.nan)))
        settings.append(results.Setting(
            number, {k: trial.params[k] for k in plan.space.choices}, trial.state.name.lower(), done,
            plan.metric, pruned_at, math.nan if pruned_at is None else trial.intermediate_values[pruned_at],
            stopped))
    keys = list(plan.space.choices)
    board = results.leaderboard(settings, plan.metric, plan.direction)
    files.write_text(out / "sweep.md", board)
    files.write_text(out / "sweep.csv", results.runs_csv(settings, keys))
    results.figure(settings, keys, plan.metric, out / "sweep.png")
    log.info("sweep: leaderboard (%s)\n%s", out / "sweep.md", board)
    if plan.fold_of is not None:
        written = results.out_of_fold(settings, plan.fold_of, out)
        log.info("sweep: out-of-fold predictions in %s (%d files)", out / "oof", len(written))
    complete = [s for s in results.ranked(settings, plan.direction) if s.state == "complete"]
    if not complete:
        log.warning("sweep: no setting ran to the end; no final/")
        return 0
    best = complete[0]
    if sweep.refit:
        refit = runs.Run(best.number, best.params, cfg.seed, None, None, name="refit")
        runs.execute(refit, out / runs.TRIALS, config_file, slots, preloaded=preloaded)
        folder, source = out / runs.TRIALS / "refit" / "final", (
            f"the chosen setting trained again with seed {cfg.seed} on the train split, no fold held out "
            f"(`sweep.refit`; validation: data.eval_split or its held-out share), in trials/refit/")
    else:
        sign = 1 if plan.direction == "max" else -1
        best_run, summary = max(best.runs, key=lambda r: sign * float(r[1]["final_eval"][plan.metric]))
        folder, source = out / runs.TRIALS / best_run.id / "final", (
            f"the best run of the chosen setting, trials/{best_run.id}/ ({plan.metric} "
            f"{summary['final_eval'][plan.metric]:.4f}), copied")
    how = results.how_chosen(best, settings, plan.metric, plan.direction, sweep.method, sweep.seeds,
                             sweep.folds, source)
    results.write_final(folder, out, how)
    log.info("sweep: final/ holds %s", source)
    return 0
