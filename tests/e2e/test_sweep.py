"""`python -m trainer sweep` end to end on the tiny model: trials are ordinary runs of one process
each (forked, sweep.preload), two at a time; a sweep killed mid-way (SIGKILL to its process
group and every process under it, as a scheduler cancels a job) and started again reruns no
finished trial and ranks as an uninterrupted sweep does; 3-fold cross-validation writes each
train row's out-of-fold prediction once."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.outputs import assert_picture, chromatic, complete_steps, goodput_bars, read_metrics, read_summary
from support.processes import kill_tree, signals_in
from support.runs import BASE_ENV, PYTHON, REPO, failure_output, launch, tiny_overrides, trainer_command
from support.sweeps import sweep_holding_ranks
from support.weights import compare_weights

from trainer.runtime.launch import trainer_program
from trainer.sweep.stats import t_interval

GRID = "sweep.parameters={train.lr: [0.001, 0.01], train.warmup_ratio: [0.0, 0.5]}"


def sweep_overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Tiny trials: 2 steps, a checkpoint at each (so a killed trial resumes from one), a
    small validation split; ranked by validation loss, which every setting moves."""
    return [*tiny_overrides(model, data, out, **{"train.max_steps": 2, "train.batch_size": 8, "checkpoint.every": 1,
                                                 "data.max_eval_samples": 48, "data.max_length": 32}),
            "sweep.seeds=2", "sweep.parallel=2", "sweep.metric=loss", *extra]


def sweep_command(overrides: list[str]) -> list[str]:
    return [PYTHON, *trainer_program("sweep", None, overrides)]


def trials(out: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((out / "trials").iterdir())}


@dataclass
class Sweep:
    out: Path
    together: list[str]
    """The trials whose ranks were frozen at once: two runs of the sweep alive, both mid-run."""


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, reviews, tmp_path_factory) -> Sweep:
    """The grid swept, each trial's rank frozen as its step 2 begins (step 1 trained and
    saved) and let go at once, but the first, held until a second trial's rank is frozen beside
    it: a sweep that runs two at a time gets there, one that ran one at a time never would."""
    out = tmp_path_factory.mktemp("sweep") / "out"
    together: list[str] = []

    def release(frozen: dict[int, str]) -> list[int]:
        if not together:
            if len(frozen) < 2:
                return []  # the first trial's rank waits for a second beside it
            together.extend(sorted(frozen.values()))
        return list(frozen)

    result = sweep_holding_ranks(sweep_command(sweep_overrides(tiny_model, reviews, out, GRID)), out, "step:2",
                                 release)
    assert result.returncode == 0, failure_output(result.output)
    assert result.output.count(": train forked, preloaded (pid") == 8, failure_output(result.output)  # sweep.preload
    return Sweep(out, together)



@pytest.mark.parametrize("nproc", [None, 2], ids=["one-process", "two-ranks"])
def test_a_trial_run_alone_trains_what_it_trained_in_the_sweep(uninterrupted, tmp_path, nproc):
    """Trial 001-seed43 run by hand, as its trial.log says the sweep ran it: the sweep's config
    (sweep.yaml), its setting and seed, and the sweep's train.threads. In one process (the
    trial had one rank, forked from the sweep's zygote: nothing left over from it or from the
    trials before), the same bits; on 2 ranks of the same global batch, within 1e-6, as any
    run at another world size."""
    out = uninterrupted.out
    with (out / "sweep.csv").open() as f:
        row = next(r for r in csv.DictReader(f) if r["trial"] == "001-seed43")
    alone = tmp_path / "alone"
    overrides = [f"train.lr={row['train.lr']}", f"train.warmup_ratio={row['train.warmup_ratio']}", "seed=43",
                 "train.threads=1", f"output_dir={alone}"]
    if nproc == 2:
        overrides += ["train.global_batch=8", "train.batch_size=4"]
    result = launch(trainer_command(overrides, nproc, config=str(out / "sweep.yaml")))
    assert result.returncode == 0, failure_output(result.output)
    diff = compare_weights(out / "trials" / "001-seed43", alone, 2)
    assert diff.max_abs <= 1e-6 and (nproc == 2 or not diff.differing), diff

def test_a_grid_of_settings_and_seeds_runs_two_trials_at_a_time(uninterrupted):
    out = uninterrupted.out
    assert sorted(trials(out)) == [f"{s:03d}-seed{seed}" for s in range(4) for seed in (42, 43)]
    for folder in trials(out).values():  # each an ordinary run: its summary, its final model, its config
        assert (folder / "summary.json").is_file() and (folder / "final" / "model.safetensors").is_file()
    assert len(set(uninterrupted.together)) == 2 and set(uninterrupted.together) <= set(trials(out)), \
        uninterrupted.together  # two trials mid-run at once
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["trial"] for r in rows} == set(trials(out))
    by_setting: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        assert float(r["loss"]) == json.loads((out / "trials" / r["trial"] / "summary.json").read_text())[
            "final_eval"]["loss"]
        by_setting.setdefault((r["train.lr"], r["train.warmup_ratio"]), []).append(float(r["loss"]))
    assert sorted(by_setting) == [("0.001", "0.0"), ("0.001", "0.5"), ("0.01", "0.0"), ("0.01", "0.5")]
    board = (out / "sweep.md").read_text()
    means = sorted((t_interval(v).mean, k) for k, v in by_setting.items())
    lines = [line for line in board.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(lines) == 4
    for line, (mean, (lr, warmup)) in zip(lines, means, strict=True):  # lowest loss first
        interval = t_interval(by_setting[(lr, warmup)])
        row = f"train.lr={lr}, train.warmup_ratio={warmup} | {mean:.4f} | [{interval.low:.4f}, {interval.high:.4f}]"
        assert f"{row} | 2 | complete |" in line, board
    # sweep.png: a panel per swept key (2, side by side), each with its settings' means plotted
    # in colour, the axes and text in grey. Where the points fall is the axes' scale's to say.
    pixels = assert_picture(out / "sweep.png", min_size=(600, 240))
    panels = np.array_split(chromatic(pixels), 2, axis=1)
    assert all(panel.sum() >= 20 for panel in panels), [int(panel.sum()) for panel in panels]
    # `report` of the sweep: each run's goodput, in its folder and a line each, and the sweep's.
    reported = subprocess.run([PYTHON, "-m", "trainer", "report", str(out)], cwd=REPO, env=BASE_ENV,
                              capture_output=True, text=True, timeout=120)
    assert reported.returncode == 0, reported.stderr[-3000:]
    sweep_goodput = json.loads((out / "goodput.json").read_text())
    assert sorted(sweep_goodput["runs"]) == sorted(trials(out))
    for name, folder in trials(out).items():
        own = json.loads((folder / "goodput.json").read_text())
        assert sweep_goodput["runs"][name]["goodput"] == own["goodput"] and own["steps_kept"] == 2
        assert f"  {name} " in reported.stdout
        bars = goodput_bars(assert_picture(folder / "goodput.png", min_size=(400, 100)))
        assert len(bars) == 2, bars  # its one attempt's, the legend's
    productive = sum(r["productive_s"] for r in sweep_goodput["runs"].values())
    assert sweep_goodput["goodput"] == pytest.approx(productive / sweep_goodput["run_wall_s"])
    assert reported.stdout.startswith("sweep of 8 runs (8 started)")
    best_lr, best_warmup = means[0][1]
    card = (out / "final" / "README.md").read_text()
    assert "## How this model was chosen" in card and f"train.lr={best_lr}, train.warmup_ratio={best_warmup}" in card
    assert (out / "final" / "model.safetensors").is_file()


def test_a_killed_sweep_started_again_reruns_no_finished_trial(uninterrupted, tiny_model, reviews, tmp_path):
    out = tmp_path / "out"
    command = sweep_command(sweep_overrides(tiny_model, reviews, out, GRID))
    proc = subprocess.Popen(command, cwd=REPO, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the sweep says a trial has finished
            seen.append(line)
            if ": finished: validation" in line:
                break
    finally:
        kill_tree(proc)  # its process group and every process under it (the zygote's runs among them)
        proc.communicate()
    assert any(": finished: validation" in line for line in seen), "".join(seen)[-4000:]
    finished = {name: (p / "summary.json").read_bytes() for name, p in trials(out).items()
                if (p / "summary.json").is_file()}
    assert 1 <= len(finished) < 8, finished.keys()

    again = launch(command, timeout=400)
    assert again.returncode == 0, failure_output(again.output)
    for name, summary in finished.items():
        # Its setting's result told to the study before the kill, or not yet (its runs read again).
        assert (f"trial {name}: finished before, not run again" in again.output
                or f"sweep: setting {int(name[:3])} finished before, not run again" in again.output), name
        assert f"trial {name}: training" not in again.output
        assert (out / "trials" / name / "summary.json").read_bytes() == summary
    assert sorted(trials(out)) == sorted(trials(uninterrupted.out))
    assert (out / "sweep.md").read_text() == (uninterrupted.out / "sweep.md").read_text()


def test_three_fold_cross_validation_predicts_every_train_row_once(tiny_model, reviews, tmp_path):
    """And with sweep.refit, final/ is the chosen setting trained again on the whole train split."""
    out = tmp_path / "out"
    result = launch(sweep_command(sweep_overrides(tiny_model, reviews, out, "sweep.seeds=1", "sweep.folds=3",
                                                  "data.max_eval_samples=null", "sweep.refit=true")), timeout=400)
    assert result.returncode == 0, failure_output(result.output)
    assert sorted(trials(out)) == ["000-seed42-fold0", "000-seed42-fold1", "000-seed42-fold2", "refit"]
    card = (out / "final" / "README.md").read_text()
    assert "rows: train 600, validation 203" in card and "trained again with seed 42" in card
    assert f'from_pretrained("{out / "final"}")' in card  # its usage names final/, not the trial's copy
    fold_card = (out / "trials" / "000-seed42-fold0" / "final" / "README.md").read_text()
    assert "rows: train 400, validation 200" in fold_card
    with (out / "oof" / "000-seed42.csv").open() as f:
        rows = list(csv.DictReader(f))
    labels = [json.loads(line)["label"] for line in (reviews / "train.jsonl").read_text().splitlines()]
    assert [int(r["train_row"]) for r in rows] == list(range(len(labels)))  # every row once, in order
    assert [r["true"] for r in rows] == [f"LABEL_{label}" for label in labels]
    folds = np.array([int(r["fold"]) for r in rows])
    assert np.bincount(folds).tolist() == [200, 200, 200]
    for fold in range(3):  # each fold's rows validated the run that did not train on them
        summary = json.loads((out / "trials" / f"000-seed42-fold{fold}" / "summary.json").read_text())
        predicted = [r for r in rows if int(r["fold"]) == fold]
        assert len(predicted) == 200
        accuracy = np.mean([r["true"] == r["label_name"] for r in predicted])
        assert accuracy == pytest.approx(summary["final_eval"]["accuracy"])


PRUNED_STEPS = 12
FROZEN_AT = 7
"""The bad setting's run is judged at its first evaluation (step 5) once it has logged step 6
(train.log_every=2), and its rank stops itself (SIGSTOP) as step 7 begins: the sweep's signal
finds it there, however fast it trained, and it saves at the next step boundary (or the one
after: trainer/faults/preemption.py `agreed`), before its end."""


def test_halving_stops_a_bad_setting_at_its_first_evaluation(tiny_model, reviews, tmp_path):
    """sweep.pruner=halving on the runs' own evaluations (every 5 steps): a learning rate of
    0.3 throws the validation loss far above where it starts, and the grid (seeded) asks it
    after 0.001. Successive halving's first rung is the first evaluation: the bad setting is
    stopped there, its run (one process, forked: sweep.preload) saving and exiting 75, and the
    sweep ranks it after the good one, which runs to the end, and exits 0. Each run's rank is
    frozen as step FROZEN_AT begins; the good one's is let go at once, the bad one's once the
    sweep's stop signal waits for it (SIGTERM pending)."""
    out = tmp_path / "out"
    overrides = [*tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": PRUNED_STEPS, "train.batch_size": 8, "train.eval_every": 5,
        "checkpoint.every": 10 * PRUNED_STEPS, "data.max_eval_samples": 48, "data.max_length": 32}),
        "sweep.parameters={train.lr: [0.3, 0.001]}", "sweep.pruner=halving", "sweep.parallel=1",
        "sweep.metric=loss"]
    bad, good = out / "trials" / "000-seed42", out / "trials" / "001-seed42"
    signalled: list[str] = []

    def release(frozen: dict[int, str]) -> list[int]:
        let_go = []
        for pid, trial in frozen.items():
            if trial == bad.name:
                if signal.SIGTERM not in signals_in(pid, "SigPnd", "ShdPnd"):
                    continue  # judged (step 6 is logged), not yet stopped: the sweep's signal is still to come
                signalled.append(trial)
            let_go.append(pid)
        return let_go

    result = sweep_holding_ranks(sweep_command(overrides), out, f"step:{FROZEN_AT}", release)
    assert result.returncode == 0, failure_output(result.output)
    assert signalled == [bad.name]
    assert result.output.index("trial 001-seed42: training") < result.output.index("trial 000-seed42: training")
    assert read_summary(good)["steps"] == PRUNED_STEPS
    assert not (bad / "summary.json").exists()  # stopped, not finished
    saved = complete_steps(bad)
    assert saved in ([FROZEN_AT], [FROZEN_AT + 1]), saved  # the save at the signal, the only one
    bad_loss, good_at_5 = (next(r["eval/loss"] for r in read_metrics(t) if r["step"] == 5 and "eval/loss" in r)
                           for t in (bad, good))
    assert bad_loss > good_at_5 + 0.5
    assert "setting 0 ({'train.lr': 0.3}) pruned at step 5" in result.output, failure_output(result.output)
    assert "trial 000-seed42: stopped, its setting pruned (exit 75)" in result.output
    board = (out / "sweep.md").read_text()
    good_loss = read_summary(good)["final_eval"]["loss"]
    assert f"| 1 | train.lr=0.001 | {good_loss:.4f} | (one run) | 1 | complete |" in board, board
    assert f"| 2 | train.lr=0.3 | {bad_loss:.4f} | (at step 5) | 1 | pruned at step 5 |" in board, board
    with (out / "sweep.csv").open() as f:
        rows = {r["trial"]: r for r in csv.DictReader(f)}
    assert (rows["000-seed42"]["state"], rows["000-seed42"]["steps"]) == ("pruned", "5")
    assert float(rows["000-seed42"]["loss"]) == bad_loss
    assert (out / "final" / "model.safetensors").is_file()
