"""A run SIGKILLed twice and preempted once, then finished (4 attempts of one process each,
checkpoint every 4 steps), as `python -m trainer report` and `plot` and TensorBoard see it.
The report's redone work is exactly the steps between each kill and the checkpoint the next
attempt resumed from, each attempt's end is named, and every second of the wall time is in one
category. The curves (curves.png, the TensorBoard scalars) are one line across the restarts,
which the picture marks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.outputs import assert_picture, goodput_bars, model_card, read_metrics, read_summary
from support.runs import launch, run_preloaded, tiny_overrides, trainer_command

from trainer.outputs import curves

SETTINGS = {"train.batch_size": 16, "train.max_steps": 24, "checkpoint.every": 4, "train.eval_every": 6,
            "tracking.curves": True, "tracking.tensorboard": True}
ATTEMPTS = [  # the faults of each launch, and its exit: killed as step 11 begins, then 15, preempted at 18
    ({"TRAINER_FAULT_SIGKILL": "0:11"}, -9), ({"TRAINER_FAULT_SIGKILL": "0:15"}, -9),
    ({"TRAINER_FAULT_SIGTERM": "0:18"}, 75), ({}, 0)]


def test_the_report_counts_the_work_each_kill_threw_away_and_the_curves_run_on_across_restarts(
        tiny_model, reviews, tmp_path):
    out = tmp_path / "run"
    command = trainer_command(tiny_overrides(tiny_model, reviews, out, **SETTINGS), None)
    for faults, code in ATTEMPTS:
        result = launch(command, faults)
        assert result.returncode == code, result.output[-3000:]

    (out / "goodput.png").unlink()  # the run's own, as it ended: report draws it anew
    reported = run_preloaded("trainer", ["report", str(out)])
    assert reported.returncode == 0, reported.output[-3000:]
    report = json.loads((out / "goodput.json").read_text())
    attempts = report["attempts"]
    assert [a["resumed_from"] for a in attempts] == [0, 8, 12, 18]
    assert [a["ended_how"] for a in attempts] == ["killed", "killed", "preempted after a checkpoint (restart)",
                                                  "done"]
    assert [a["redone"] for a in attempts] == [[9, 10], [13, 14], [], []]
    assert [a["trained"] for a in attempts] == [10, 6, 6, 6]
    assert (report["steps_kept"], report["steps_redone"], report["restarts"]) == (24, 4, 3)
    assert all(a["first_step_s"] > a["seconds"]["startup"] > 0 for a in attempts)
    seconds = report["seconds"]
    assert sum(seconds.values()) == pytest.approx(report["wall_s"])
    assert min(seconds.values()) >= 0 and seconds["redone"] > 0 and seconds["checkpoints"] > 0
    assert report["goodput"] == pytest.approx(seconds["productive"] / report["wall_s"])
    assert "4 attempts (3 restarts)" in reported.output and "24 steps kept, 4 redone" in reported.output
    # The picture, drawn anew: a bar per attempt on one time axis, each as long as the attempt
    # lasted; the lengths' shares of the whole, not their pixels, which the axis' scale sets.
    *bars, _legend = goodput_bars(assert_picture(out / "goodput.png", min_size=(400, 150)))
    lasted = [a["ended"] - a["launched"] for a in attempts]
    assert len(bars) == len(attempts), bars
    assert np.array(bars) / sum(bars) == pytest.approx(np.array(lasted) / sum(lasted), abs=0.03), (bars, lasted)

    # summary.json, written as the last attempt ended, has the same account.
    summary = read_summary(out)["goodput"]
    assert [(a["resumed_from"], a["ended_how"], a["redone"]) for a in summary["attempts"]] == \
        [(a["resumed_from"], a["ended_how"], a["redone"]) for a in attempts]
    assert (summary["steps_kept"], summary["steps_redone"]) == (24, 4)

    # The curves: one line from step 2 to 24 (metrics.jsonl forgot the redone steps' lines),
    # the restarts at the checkpoints they went on from; in the PNG, final/ and its card.
    drawn = curves.series(out)
    assert drawn.train["loss"][0] == list(range(2, 25, 2)) and drawn.restarts == [8, 12, 18]
    assert drawn.validation["accuracy"][0] == [6, 12, 18, 24]
    plotted = run_preloaded("trainer", ["plot", str(out)])
    assert plotted.returncode == 0 and plotted.output.strip().endswith(str(out / "curves.png"))
    for png in (out / "curves.png", out / "final" / "curves.png"):
        assert_picture(png, min_size=(400, 300))
    assert len(goodput_bars(assert_picture(out / "final" / "goodput.png", min_size=(400, 150)))) == len(attempts) + 1
    card = model_card(out / "final").text
    assert "](curves.png)" in card and "](goodput.png)" in card  # with the attempts' timeline
    # TensorBoard's own reader: every step once, after its purge of the steps redone.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(m["step"], m["loss"]) for m in read_metrics(out) if "loss" in m]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(step, pytest.approx(loss, rel=1e-6))
                                                                     for step, loss in logged]


def test_report_of_a_folder_that_never_trained_is_one_line(tmp_path, usage_run):
    result = run_preloaded("trainer", ["report", str(tmp_path)])
    assert result.returncode == 2 and result.output.strip() == \
        f"error: report: {tmp_path}: no attempts.jsonl: not the output_dir of a run that trained"
