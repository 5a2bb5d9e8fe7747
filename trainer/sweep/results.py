"""What a sweep reports, from its study and its runs' folders: sweep.csv (a row per run), the
leaderboard (sweep.md and the log: each setting's mean with its 95% t-interval over its
seeds or folds, and their count), sweep.png (the metric against each swept key, with error
bars), the out-of-fold predictions of k-fold runs, and final/: the chosen setting's model
with a model card that says how it was chosen."""

from __future__ import annotations

import csv
import io
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer import files
from trainer.data import folds as folds_module
from trainer.sweep import runs as runs_module
from trainer.sweep.search_space import Scalar
from trainer.sweep.stats import CONFIDENCE, Interval, t_interval

log = logging.getLogger(__name__)


@dataclass
class Setting:
    number: int
    params: dict[str, Scalar]
    state: str
    """complete, or pruned (stopped by sweep.pruner before all its runs)."""
    runs: list[tuple[runs_module.Run, dict[str, Any]]]
    """Each finished run and its summary.json."""
    metric: str
    pruned_at: int | None = None
    """Pruned: the step of the evaluation at which the pruner stopped it."""
    pruned_mean: float = math.nan
    """Pruned: its runs' mean metric at pruned_at, as reported to the pruner."""
    stopped: list[tuple[runs_module.Run, float]] = field(default_factory=list)
    """Pruned: each run stopped before its end (no summary.json), with its metric at pruned_at."""

    def values(self) -> list[float]:
        return [float(summary["final_eval"][self.metric]) for _, summary in self.runs]

    @property
    def interval(self) -> Interval:
        return t_interval(self.values())

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "(the config as it is)"


def ranked(settings: list[Setting], direction: str) -> list[Setting]:
    """Complete settings best first by their mean (ties by their parameters, so the order is
    the same however the sweep ran), then pruned ones: the later stopped first (it passed more
    rungs), then by their mean there."""
    sign = -1 if direction == "max" else 1

    def key(s: Setting) -> tuple:
        if s.state == "complete":
            return (0, 0, sign * s.interval.mean, s.label())
        return (1, -(s.pruned_at or 0), sign * s.pruned_mean, s.label())

    return sorted(settings, key=key)


def _cell(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.4f}"


def leaderboard(settings: list[Setting], metric: str, direction: str) -> str:
    """sweep.md: the ranked settings, each mean with its 95% interval and its run count."""
    lines = [f"# Sweep: {metric} ({'higher' if direction == 'max' else 'lower'} is better)", "",
             f"Each setting's mean over its runs (seeds x folds), with its {CONFIDENCE:.0%} t-interval.", "",
             f"| rank | setting | {metric} mean | {CONFIDENCE:.0%} CI | runs | state |",
             "|---:|---|---:|---|---:|---|"]
    for place, s in enumerate(ranked(settings, direction), 1):
        if s.pruned_at is not None:  # its mean where it was stopped, not at the end: no interval of final values
            runs = len(s.runs) + len(s.stopped)
            lines.append(f"| {place} | {s.label()} | {_cell(s.pruned_mean)} | (at step {s.pruned_at}) | {runs} | "
                         f"pruned at step {s.pruned_at} |")
            continue
        i = s.interval
        ci = f"[{_cell(i.low)}, {_cell(i.high)}]" if i.n > 1 else "(one run)"
        lines.append(f"| {place} | {s.label()} | {_cell(i.mean)} | {ci} | {i.n} | {s.state} |")
    if any(s.pruned_at is not None for s in settings):
        lines += ["", (f"A pruned setting's mean is its runs' {metric} at the evaluation where sweep.pruner "
                       "stopped them, not at their end.")]
    return "\n".join(lines) + "\n"


def runs_csv(settings: list[Setting], keys: list[str]) -> str:
    """sweep.csv: a row per run."""
    out = io.StringIO()
    writer = csv.writer(out)
    metric = settings[0].metric if settings else "metric"
    writer.writerow(["trial", "setting", "state", *keys, "seed", "fold", metric, "steps"])
    for s in sorted(settings, key=lambda s: s.number):
        rows = [(run, summary["final_eval"][s.metric], summary["steps"]) for run, summary in s.runs]
        rows += [(run, value, s.pruned_at) for run, value in s.stopped]  # where the pruner stopped it
        for run, value, steps in sorted(rows, key=lambda row: row[0].id):
            writer.writerow([run.id, s.number, s.state, *(s.params.get(k) for k in keys), run.seed,
                             "" if run.fold is None else run.fold, "" if math.isnan(value) else value, steps])
    return out.getvalue()


def figure(settings: list[Setting], keys: list[str], metric: str, path: Path) -> None:
    """sweep.png: for each swept key, each setting's mean against its value, with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in settings if s.runs]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4 * max(1, len(keys)), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys or [""], strict=True):
        values = [s.params.get(key) for s in shown]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        ticks = sorted({str(v) for v in values})
        xs = [float(v) for v in values] if numeric else [float(ticks.index(str(v))) for v in values]  # type: ignore[arg-type]
        means = [s.interval.mean for s in shown]
        errors = [0.0 if math.isnan(s.interval.half_width) else s.interval.half_width for s in shown]
        ax.errorbar(xs, means, yerr=errors, fmt="o", capsize=4)
        if numeric and len(set(xs)) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel(key or "setting")
        ax.set_ylabel(f"{metric} (mean, {CONFIDENCE:.0%} CI)")
    fig.tight_layout()
    files.write_figure(fig, path, dpi=100)
    plt.close(fig)


def out_of_fold(settings: list[Setting], fold_of: np.ndarray, out: Path) -> list[Path]:
    """For each setting and seed run on every fold: oof/<setting>-seed<seed>.csv, every train
    row once, in order, with the fold that held it out and the answer of the model that did
    not train on it (each fold's eval-SPLIT-rows.csv, its rows mapped back to the train split)."""
    written = []
    for s in settings:
        by_seed: dict[int, dict[int, runs_module.Run]] = {}
        for run, _ in s.runs:
            if run.fold is not None:
                by_seed.setdefault(run.seed, {})[run.fold] = run
        for seed, folds in sorted(by_seed.items()):
            if len(folds) != int(fold_of.max()) + 1:
                continue  # pruned before its last fold
            header: list[str] = []
            rows: list[list[str]] = []
            for fold, run in sorted(folds.items()):
                held = folds_module.held_out(fold_of, fold)[1]
                rows_file = runs_module.rows_file(out / runs_module.TRIALS / run.id)
                assert rows_file is not None, f"trial {run.id} finished with its rows"
                with rows_file.open(newline="") as f:
                    reader = csv.reader(f)
                    header = next(reader)
                    rows += [[str(held[int(row[0])]), str(fold), *row[1:]] for row in reader]
            rows.sort(key=lambda row: int(row[0]))
            text = io.StringIO()
            writer = csv.writer(text)
            writer.writerow(["train_row", "fold", *header[1:]])
            writer.writerows(rows)
            path = out / "oof" / f"{s.number:03d}-seed{seed}.csv"
            path.parent.mkdir(exist_ok=True)
            files.write_text(path, text.getvalue())
            written.append(path)
    return written


def write_final(model_folder: Path, out: Path, how: str) -> Path:
    """output_dir/final: a copy of `model_folder` (a run's final/), its card told `how` it was
    chosen; published whole (written aside, then renamed)."""
    final, tmp = out / "final", out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_folder, tmp)
    card = tmp / "README.md"  # the run's card, its usage naming this folder rather than the run's
    card.write_text((card.read_text().replace(str(model_folder), str(final)) if card.is_file() else "") + "\n" + how)
    files.rename_into_place(tmp, final)
    return final


def how_chosen(best: Setting, settings: list[Setting], metric: str, direction: str, method: str, seeds: int,
               folds: int | None, source: str) -> str:
    """The model card's section on the sweep."""
    i = best.interval
    ci = f", {CONFIDENCE:.0%} CI [{_cell(i.low)}, {_cell(i.high)}]" if i.n > 1 else ""
    complete = sum(s.state == "complete" for s in settings)
    return "\n".join([
        "## How this model was chosen", "",
        f"By `python -m trainer sweep` ({method}): {len(settings)} settings tried ({complete} to the end), each "
        f"with {seeds} seed{'s' if seeds > 1 else ''}" + (f" x {folds} folds of the train split" if folds else "")
        + f", ranked by the mean validation {metric} ({'higher' if direction == 'max' else 'lower'} is better).", "",
        f"The chosen setting: {best.label()}: {metric} {_cell(i.mean)}{ci} over {i.n} run{'s' if i.n > 1 else ''}.",
        "", f"This model: {source}.", "",
    ])
