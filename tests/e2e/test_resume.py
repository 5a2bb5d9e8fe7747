"""Kill a rank with SIGKILL mid-run, relaunch: the result is bitwise the uninterrupted run's.

The tiny model here has dropout on, so this also proves every rank's RNG state is restored.
600 samples / global batch 16 = 37 steps per epoch: the checkpoints resumed from are
mid-epoch, and the resumed runs cross the epoch boundary. wandb runs offline, as by default.
"""

import json
from pathlib import Path

import pytest
from support import wandb_log
from support.outputs import read_metrics, read_summary
from support.runs import kill_then_resume, launch, locally, tiny_overrides, train, trainer_command
from support.weights import compare_weights, weights

STEPS = 40
# Logged values are means over a logging window; a window after a resume starts at the
# checkpoint, so windows line up with an uninterrupted run's when checkpoint.every is a
# multiple of train.log_every (as with the defaults).
OPTIONS = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 5, "checkpoint.keep": 3,
           "train.log_every": 5, "wandb.mode": "offline",
           "data.num_workers": 1}  # the default: a fault must end the loader's worker too


@pytest.fixture(scope="module")
def uninterrupted(reference_run, dropout_model):
    return reference_run(locally(2), dropout_model, **OPTIONS).run


def metrics_by_step(output_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for record in read_metrics(output_dir):
        rows.setdefault(record.pop("step"), {}).update(record)
    return rows


def merged_history(output_dir: Path) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for log in wandb_log.runs(output_dir):
        for step, row in wandb_log.history(log).items():
            merged.setdefault(step, {}).update(row)
    return merged


def test_dropout_is_on_while_training(uninterrupted, dropout_model, tiny_model, reviews, tmp_path):
    """The model here is tiny_model with dropout 0.1, the same weights otherwise: the same
    run of the two ends apart only if dropout draws while training. Otherwise the bitwise
    resumes below would prove nothing about the RNG states they restore."""
    assert not compare_weights(weights(tiny_model), weights(dropout_model)).differing
    train(tiny_overrides(tiny_model, reviews, tmp_path, **OPTIONS))
    assert compare_weights(uninterrupted, tmp_path, STEPS).max_abs > 1e-3


@pytest.mark.parametrize(
    "kill, resumed_from, async_save",
    [pytest.param("0:38", 35, False, id="rank0-step38"),
     # Rank 0 writes in the background while rank 1 dies; on its way out it finishes the
     # write, so step 20 is complete (not torn) and the resume is still exact.
     pytest.param("1:23", 20, True, id="rank1-step23-async-save")],
)
def test_sigkill_then_resume_is_bitwise_exact(uninterrupted, dropout_model, reviews, tmp_path, kill, resumed_from,
                                              async_save):
    overrides = tiny_overrides(dropout_model, reviews, tmp_path, **OPTIONS, **{"checkpoint.async_save": async_save})
    killed = launch(trainer_command(overrides, nproc=2), env={"TRAINER_FAULT_SIGKILL": kill})
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    assert not (tmp_path / "summary.json").exists()
    resume_point = json.loads((tmp_path / "checkpoints" / f"step-{resumed_from}" / "state.json").read_text())
    assert resume_point["step_in_epoch"] != 0, "the resume point should be mid-epoch"

    resumed = train(overrides)
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{resumed_from}'}" in resumed.output
    summary = read_summary(tmp_path)
    assert summary["resumed_from_step"] == resumed_from

    assert not compare_weights(uninterrupted, tmp_path, STEPS).differing
    # The logged global loss is the same at every step, including the redone ones.
    losses = lambda out: {s: r["loss"] for s, r in metrics_by_step(out).items() if "loss" in r}  # noqa: E731
    assert losses(tmp_path) == losses(uninterrupted)
    assert summary["final_eval"] == read_summary(uninterrupted)["final_eval"]

    # wandb: one run id for both launches, one wandb run per launch (rank 0 only), and the
    # history it recorded is what metrics.jsonl holds. (A SIGKILLed rank 0 can take the last
    # seconds of wandb's buffered offline log with it; metrics.jsonl is written line by line.)
    logs = wandb_log.runs(tmp_path)
    assert len(logs) == 2
    assert set().union(*(wandb_log.run_ids(log) for log in logs)) == {summary["wandb_run_id"]}
    metrics = metrics_by_step(tmp_path)
    for step, row in merged_history(tmp_path).items():
        assert row == metrics[step], step
    after_resume = {step: row for step, row in metrics.items() if step > resumed_from}
    assert wandb_log.history(logs[1]) == after_resume


def test_activation_checkpointing_changes_no_bit_and_a_resume_may_turn_it_off(uninterrupted, dropout_model, reviews,
                                                                               tmp_path):
    """model.gradient_checkpointing recomputes each layer in the backward, replaying its
    dropout masks: a run with it, SIGKILLed at step 23 and resumed without it (a FREE key),
    ends bitwise equal to the uninterrupted run that never used it."""
    overrides = tiny_overrides(dropout_model, reviews, tmp_path, **OPTIONS)
    killed = launch(trainer_command([*overrides, "model.gradient_checkpointing=true"], nproc=2),
                    env={"TRAINER_FAULT_SIGKILL": "1:23"})
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    assert "attention eager, activation checkpointing; trains" in killed.output
    resumed = train(overrides)
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-20'}" in resumed.output
    assert not compare_weights(uninterrupted, tmp_path, STEPS).differing


def test_wandb_history_matches_metrics_file(uninterrupted):
    logs = wandb_log.runs(uninterrupted)
    assert len(logs) == 1
    history = wandb_log.history(logs[0])
    assert history == metrics_by_step(uninterrupted)
    assert sorted(history) == list(range(5, STEPS + 1, 5))
    assert {"loss", "lr", "samples_per_s", "tokens_per_s", "mfu", "eval/accuracy", "eval/f1_macro"} <= set(
        history[STEPS]
    )


FP16 = {"train.precision": "fp16", "train.batch_size": 8, "train.max_steps": 10, "checkpoint.every": 5,
        "train.log_every": 1, "wandb.mode": "disabled"}
OVERFLOW_AT_STEP_3 = {"TRAINER_FAULT_OVERFLOW": "*:3"}


def test_fp16_loss_scale_is_part_of_the_exact_resume(reference_run, dropout_model, reviews, tmp_path):
    """fp16 with torch.amp.GradScaler, for real on CPU ranks. Step 3's gradients overflow
    (injected into every rank, as an all-reduced overflow reaches all): the step is skipped
    and the scale halved. Killed at step 8 and resumed from step 5, the run must go on with
    the halved scale, as the uninterrupted one does, and end bitwise equal to it."""
    uninterrupted = reference_run(lambda overrides, _: train(overrides, env=OVERFLOW_AT_STEP_3), dropout_model,
                                  **FP16).run
    scales = lambda out: {s: r["loss_scale"] for s, r in metrics_by_step(out).items() if "loss_scale" in r}  # noqa: E731
    assert scales(uninterrupted) == {s: 65536.0 if s < 3 else 32768.0 for s in range(1, 11)}

    # The relaunch overflows nowhere: its scale can only come from the checkpoint.
    kill_then_resume(tiny_overrides(dropout_model, reviews, tmp_path, **FP16), tmp_path,
                     {**OVERFLOW_AT_STEP_3, "TRAINER_FAULT_SIGKILL": "1:8"}, resumed_from=5)
    assert scales(tmp_path) == scales(uninterrupted)
    assert not compare_weights(uninterrupted, tmp_path, 10).differing
