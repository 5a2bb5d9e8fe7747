"""A preemption signal to the sweep's process alone, as Kubernetes sends SIGTERM to a
container's first process: the sweep passes it on to every trial, which saves and exits 75,
starts no other, and exits 75 once they have ended, leaving no process behind. Started again,
it resumes each trial from the checkpoint it saved at the signal."""

from __future__ import annotations

import signal
import subprocess

import psutil
from support.outputs import read_metrics, read_summary
from support.processes import kill_tree, wait_for
from support.runs import BASE_ENV, PYTHON, REPO, failure_output, launch, tiny_overrides

from trainer.runtime.launch import trainer_program

STEPS = 400
"""Enough for the signal, sent once both trials have logged a step, to find them training."""


def stepped(folder) -> bool:
    """Whether the trial has logged a training step (metrics.jsonl: train.log_every=1)."""
    return (folder / "metrics.jsonl").is_file() and any("samples_per_s" in r for r in read_metrics(folder))


def test_a_signal_to_the_sweep_alone_reaches_every_trial_which_saves(tiny_model, reviews, tmp_path):
    out = tmp_path / "out"
    overrides = [*tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": STEPS, "train.log_every": 1, "train.batch_size": 8, "checkpoint.every": 10 * STEPS,
        "data.max_eval_samples": 48, "data.max_length": 32}),
        "sweep.parameters={train.lr: [0.001, 0.01]}", "sweep.parallel=2", "sweep.metric=loss"]
    command = [PYTHON, *trainer_program("sweep", None, overrides)]
    sweep = subprocess.Popen(command, cwd=REPO, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    trials = [out / "trials" / f"{n:03d}-seed42" for n in range(2)]
    try:
        # Both trials train: their ranks handle the signal.
        wait_for(lambda: all(stepped(t) for t in trials), 300, "both trials to log a step", {"sweep": sweep})
        under = psutil.Process(sweep.pid).children(recursive=True)
        sweep.send_signal(signal.SIGTERM)  # the sweep's process alone, not its group
        output = sweep.communicate(timeout=180)[0]
    finally:
        kill_tree(sweep)
    assert sweep.returncode == 75, failure_output(output)
    assert under and not psutil.wait_procs(under, timeout=10)[1], "processes outlived the sweep"
    assert "stopped by SIGTERM" in output, failure_output(output)
    saved = {}
    for trial in trials:
        assert not (trial / "summary.json").exists(), trial  # stopped, not finished
        steps = sorted(int(p.name.removeprefix("step-")) for p in (trial / "checkpoints").glob("step-*"))
        assert len(steps) == 1 and 0 < steps[0] < STEPS, steps  # the save at the signal, the only one
        saved[trial.name] = steps[0]

    again = launch(command, timeout=400)
    assert again.returncode == 0, failure_output(again.output)
    assert {t.name: read_summary(t)["resumed_from_step"] for t in trials} == saved
