"""A preemption signal to the sweep's process alone, as Kubernetes sends SIGTERM to a
container's first process: the sweep passes it on to every trial, which saves and exits 75,
starts no other, and exits 75 once they have ended, leaving no process behind. Started again,
it resumes each trial from the checkpoint it saved at the signal."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
from support.outputs import complete_steps, read_summary
from support.processes import kill_tree, signals_in
from support.runs import BASE_ENV, PYTHON, REPO, failure_output, launch, tiny_overrides
from support.sweeps import holding_ranks

from trainer.runtime.launch import trainer_program

FROZEN_AT = 2
"""Each trial's rank stops itself (TRAINER_FAULT_SIGSTOP) as step 2 begins, step 1 trained: the
sweep's signal is sent once both are frozen there, so it finds both mid-run however fast or
slow they train, and each is let go once the signal the sweep passed on waits in it. It saves
at the next step boundary, or the one after (trainer/faults/preemption.py `agreed`)."""
STEPS = FROZEN_AT + 2
"""Past the latest step a trial may save at: stopped, it has not finished, and started again it
has a step left to train."""
TIMEOUT_S = 480
"""The longest the sweep may run until it has exited: only a hang reaches it."""


def test_a_signal_to_the_sweep_alone_reaches_every_trial_which_saves(tiny_model, reviews, tmp_path):
    out = tmp_path / "out"
    overrides = [*tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": STEPS, "train.log_every": 1, "train.batch_size": 8, "checkpoint.every": 10 * STEPS,
        "data.max_eval_samples": 48, "data.max_length": 32}),
        "sweep.parameters={train.lr: [0.001, 0.01]}", "sweep.parallel=2", "sweep.metric=loss"]
    command = [PYTHON, *trainer_program("sweep", None, overrides)]
    log = tmp_path / "sweep.log"  # a file, not a pipe: nothing reads the sweep's output while it runs
    with log.open("w") as output_file:
        sweep = subprocess.Popen(command, cwd=REPO, env={**BASE_ENV, "TRAINER_FAULT_SIGSTOP": f"0:step:{FROZEN_AT}"},
                                 stdout=output_file, stderr=subprocess.STDOUT, start_new_session=True)
    trials = [out / "trials" / f"{n:03d}-seed42" for n in range(2)]
    under: list[psutil.Process] = []
    signalled: list[str] = []

    def release(frozen: dict[int, str]) -> list[int]:
        if not under:
            if len(frozen) < 2:
                return []  # the first trial's rank waits, frozen mid-run, for the second's
            under.extend(psutil.Process(sweep.pid).children(recursive=True))
            sweep.send_signal(signal.SIGTERM)  # the sweep's process alone, not its group
            return []
        let_go = [pid for pid in frozen if signal.SIGTERM in signals_in(pid, "SigPnd", "ShdPnd")]
        signalled.extend(frozen[pid] for pid in let_go)  # the signal the sweep passed on reached it
        return let_go

    deadline = time.monotonic() + TIMEOUT_S
    try:
        holding_ranks(out, lambda: sweep.poll() is None and time.monotonic() < deadline, release)
    finally:
        kill_tree(sweep)
    output = log.read_text()
    assert sweep.poll() is not None, f"the sweep still ran after {TIMEOUT_S}s\n{failure_output(output)}"
    assert sweep.returncode == 75, failure_output(output)
    assert sorted(signalled) == [t.name for t in trials], (signalled, failure_output(output))
    assert under and not psutil.wait_procs(under, timeout=10)[1], "processes outlived the sweep"
    assert "stopped by SIGTERM" in output, failure_output(output)
    saved = {}
    for trial in trials:
        assert not (trial / "summary.json").exists(), trial  # stopped, not finished
        steps = sorted(int(p.name.removeprefix("step-")) for p in (trial / "checkpoints").glob("step-*"))
        assert steps in ([FROZEN_AT], [FROZEN_AT + 1]), steps  # the save at the signal, the only one
        assert complete_steps(trial) == steps
        saved[trial.name] = steps[0]

    again = launch(command, timeout=400)
    assert again.returncode == 0, failure_output(again.output)
    assert {t.name: read_summary(t)["resumed_from_step"] for t in trials} == saved
