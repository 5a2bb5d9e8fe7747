"""The restart contract under torchrun: the launch's exit code says what a scheduler should do.

`python -m trainer.cli.torchrun` (every launcher's command) passes on its workers' verdict
(trainer/exit_codes.py) where torch's torchrun exits 1 for all. A usage error's 2 is in
tests/e2e/test_usage_errors.py, a node fault's 76 in tests/system/test_multinode_faults.py
(a frozen node), a preemption's 75 in tests/system/test_slurm.py.
"""

from __future__ import annotations

import json
import re
import socket

from support.runs import run, tiny_overrides

from trainer.exit_codes import Exit
from trainer.runtime.launch import torchrun_argv, trainer_program


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_that_fails_again_from_the_same_checkpoint_stops_with_no_progress(tiny_model, reviews, tmp_path):
    """One launch, torchrun restarting the workers twice: attempt 0 crashes at step 5 (after
    step 4's checkpoint), attempt 1 resumes from step 4, reading the splits attempt 0 tokenized
    from the cache, and is killed at step 5 again. With fault.max_stalled_restarts=1, attempt 2
    refuses on every rank before loading any weights, and the launch exits 77 (do not retry)
    instead of 1."""
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": 8, "checkpoint.every": 2, "fault.max_stalled_restarts": 1})
    # Through our rendezvous, as every launcher's: its fresh worker store per restart keeps a
    # restarted worker from reading its predecessor's gloo address (--standalone's shared store).
    argv = torchrun_argv(2, trainer_program(overrides=overrides), rdzv_endpoint=f"127.0.0.1:{free_port()}",
                         torchrun_args=("--max-restarts=2",))
    result = run(argv, timeout=240, env={"TRAINER_FAULT_RAISE": "1:5", "TRAINER_FAULT_SIGKILL": "1@1:5"})
    assert result.returncode == Exit.NO_PROGRESS, result.output[-5000:]
    assert "InjectedFault" in result.output, result.output[-5000:]
    refusal = ("error: the last attempt resumed from step 4 and failed; not retrying (fault.max_stalled_restarts=1)")
    assert refusal in result.output, result.output[-5000:]
    assert "trainer.cli.torchrun: exiting with 77: no progress across restarts" in result.output
    # The two attempts that ran, as rank 0 recorded them; the refused one is not an attempt.
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert [a["resumed_from"] for a in attempts if "resumed_from" in a] == [0, 4], attempts
    # A restarted attempt reuses what is still valid: the splits the first one tokenized.
    for split in ("train_split", "eval_split"):
        read = re.findall(rf"\[rank 0\] INFO trainer.data.encoding: {split}: (.*)", result.output)
        assert len(read) == 2 and read[1].endswith("tokenized before: read from the cache"), read


def test_a_rendezvous_that_times_out_is_retryable_in_the_launchers_dialect(tiny_model, reviews, tmp_path):
    """One node of two comes: torchrun's own rendezvous times out, before any worker. Plain
    torchrun exits 1, which a PyTorchJob's ExitCode policy takes as permanent; the contract
    calls it a crash, retryable, in the dialect the launcher asked for (138 on Kubernetes)."""
    argv = torchrun_argv(1, trainer_program(overrides=tiny_overrides(tiny_model, reviews, tmp_path / "run")), nnodes=2,
                         rdzv_endpoint=f"127.0.0.1:{free_port()}", torchrun_args=("--rdzv-conf=join_timeout=3",))
    result = run(argv, timeout=120, env={"TRAINER_RETRYABLE_EXIT_CODE": "138"})
    assert result.returncode == 138, result.output[-5000:]
    assert "trainer.cli.torchrun: exiting with 138: torchrun failed, crashed (retryable)" in result.output
    assert not (tmp_path / "run").exists()  # no worker started


def test_a_checked_launch_stops_at_a_data_mistake_before_any_rank_starts(tiny_model, reviews, tmp_path):
    """TRAINER_CHECK=1 (the Kubernetes pods'): `check` first, in trainer.cli.torchrun's process; a
    label column that isn't there is one line and 2, the code no launcher retries, even in the
    Kubernetes dialect, and no rank starts (none writes output_dir)."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"data.label_field": "stars"})
    result = run(torchrun_argv(2, trainer_program(overrides=overrides)), timeout=120,
                 env={"TRAINER_CHECK": "1", "TRAINER_RETRYABLE_EXIT_CODE": "138"})
    assert result.returncode == Exit.USAGE, result.output[-5000:]
    assert "error: data.label_field: column 'stars' not in data.train_split" in result.output
    assert "trainer.cli.torchrun: exiting with 2: the check failed (usage error (do not retry)); no rank started" \
        in result.output
    assert "[rank" not in result.output and not (tmp_path / "run").exists()
