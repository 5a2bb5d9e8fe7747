"""A loss that is not finite is never trained on (trainer/faults/numerics.py).

TRAINER_FAULT_NAN makes rank 1's loss, and so its gradients and through the all-reduce every
rank's, NaN in chosen tries of chosen steps. The run:
- skips step 3's first try on every rank and tries it again with the next batch;
- fails both tries of step 7 (fault.max_bad_steps=2), so rolls back to its checkpoint at step
  5 and goes on with the batches after the bad ones, undoing step 6;
and ends bitwise equal to a run whose data simply lacked those batches (group_by_length off,
the reference's file ordered so that its shuffle reads the same batches in the same order).
A step that fails again after the rollback stops the job: exit 77, one line on every rank
naming the step and its batch, and no checkpoint after the rollback's; and before the first
checkpoint, with nothing to roll back to, at once.
"""

from __future__ import annotations

import json

import numpy as np
from support.outputs import complete_steps, read_summary
from support.runs import tiny_overrides, together, trainer_command
from support.weights import compare_weights

from trainer.data.samplers import GlobalBatchSampler
from trainer.exit_codes import Exit
from trainer.runtime.environment import DistEnv

GLOBAL_BATCH, SEED = 16, 42
SETTINGS = {"train.batch_size": 8, "train.max_steps": 12, "checkpoint.every": 5, "fault.max_bad_steps": 2,
            "data.group_by_length": False, "seed": SEED}
LACKING = [2, 6, 7, 8]
"""The global batches the faulted run trains no step on: step 3's first try (batch 2), step 6
(batch 6, undone by the rollback to step 5), step 7's two tries (batches 7 and 8)."""


def order(rows: int) -> list[int]:
    """Epoch 0's order of `rows` rows, as the run's sampler shuffles them."""
    sampler = GlobalBatchSampler(np.zeros(rows), np.zeros(rows), GLOBAL_BATCH, DistEnv(), SEED, group_by_length=False)
    return sampler.global_order(0).tolist()


def without_batches(reviews, folder, batches: list[int]):
    """The reviews without `batches` (of epoch 0), the rest in the order the faulted run reads
    them: row order_B[i] of the new file is the row the faulted run reads i-th."""
    rows = (reviews / "train.jsonl").read_text().splitlines()
    lacking = {position for batch in batches for position in range(batch * GLOBAL_BATCH, (batch + 1) * GLOBAL_BATCH)}
    read = [row for position, row in enumerate(order(len(rows))) if position not in lacking]
    placed = [""] * len(read)
    for position, row in zip(order(len(read)), read, strict=True):
        placed[position] = rows[row]
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(placed) + "\n")
    (folder / "test.jsonl").write_text((reviews / "test.jsonl").read_text())
    return folder


def test_nan_steps_are_skipped_rolled_back_and_stopped_and_the_run_equals_one_without_those_batches(
        tiny_model, reviews, tmp_path):
    faulted, reference, stopped = tmp_path / "faulted", tmp_path / "reference", tmp_path / "stopped"
    lacking = without_batches(reviews, tmp_path / "lacking", LACKING)
    skipped_and_rolled_back, equal, stop, unsaved = together(
        (trainer_command(tiny_overrides(tiny_model, reviews, faulted, **SETTINGS), 2),
         {"TRAINER_FAULT_NAN": "1:3,1:7:2"}),
        (trainer_command(tiny_overrides(tiny_model, lacking, reference, **SETTINGS), 2), {}),
        (trainer_command(tiny_overrides(tiny_model, reviews, stopped, **SETTINGS), 2), {"TRAINER_FAULT_NAN": "1:7:9"}),
        (trainer_command(tiny_overrides(tiny_model, reviews, tmp_path / "unsaved", **SETTINGS), None),
         {"TRAINER_FAULT_NAN": "0:3:9"}))
    for run in (skipped_and_rolled_back, equal):
        assert run.returncode == 0, run.output[-4000:]

    # Bitwise the run that never read those batches: weights, and the validation of them.
    assert not compare_weights(reference, faulted, 12).differing
    assert read_summary(faulted)["final_eval"] == read_summary(reference)["final_eval"]
    assert read_summary(faulted)["bad_steps"] == {"skipped_steps": 3, "rollbacks": 1, "loss_spikes": 0}
    out = skipped_and_rolled_back.output
    assert ("step 3: non-finite loss (loss nan, gradient norm nan) on batch 2 (epoch 0, samples 32-47 of its "
            "order): skipped on every rank, 1 of 2 tries in a row") in out, out[-4000:]
    assert (f"rolled back from step 7 to {faulted / 'checkpoints' / 'step-5'}: going on with the batches after the "
            "bad ones (from batch 9)") in out
    # Each bad batch is found from its record: the rows of the train split it held.
    records = [json.loads(line) for line in (faulted / "bad-batches.jsonl").read_text().splitlines()]
    epoch_order = order(600)
    assert [(r["step"], r["batch"]) for r in records] == [(3, 2), (7, 7), (7, 8)]
    for record in records:
        assert record["rows"] == epoch_order[record["batch"] * GLOBAL_BATCH:(record["batch"] + 1) * GLOBAL_BATCH]
        assert record["why"] == "non-finite loss" and record["loss"] == "nan"
    # In metrics.jsonl, the skipped tries in the window they happened in; the lines of the
    # steps the rollback undid are gone, and the rollback is logged at its checkpoint's step.
    logged = [json.loads(line) for line in (faulted / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["skipped_steps"]) for m in logged if "skipped_steps" in m] == [(4, 1), (6, 2)]
    assert [(m["step"], m["fault/rolled_back_from"]) for m in logged if "fault/rollbacks" in m] == [(5, 7)]
    assert [m["step"] for m in logged if "loss" in m] == [2, 4, 6, 8, 10, 12]

    # Step 7 fails again after the rollback: every rank stops, naming it; nothing after step 5 saved.
    errors = [line for line in stop.output.splitlines() if line.startswith("error: ")]
    assert stop.returncode == Exit.NO_PROGRESS and len(errors) == 2 and len(set(errors)) == 1, stop.output[-4000:]
    assert errors[0] == ("error: step 7 failed 2 tries in a row again after a rollback (non-finite loss, the last on "
                         "batch 10 (epoch 0, samples 160-175 of its order)): the model, not one batch, is the "
                         "problem; look at bad-batches.jsonl in output_dir, lower train.lr or raise warmup, and "
                         "resume from a checkpoint")
    assert complete_steps(stopped) == [5] and "Traceback" not in stop.output
    # Before the first checkpoint there is nothing to roll back to: it stops at once.
    assert unsaved.returncode == Exit.NO_PROGRESS and "Traceback" not in unsaved.output, unsaved.output[-3000:]
    assert ("error: step 3 failed 2 tries in a row, and there is no checkpoint to roll back to: see "
            "bad-batches.jsonl in output_dir") in unsaved.output
