"""Elastic: a run continues at any world size that divides its global batch, on the same
global batches, with nothing lost or repeated, and every resume proves it (the ledger).

The end-to-end proof: a run killed at 2 ranks, resumed in 1 process, killed again and resumed
at 3 ranks, ends with the weights and the logged losses of the uninterrupted 2-rank run within
1e-5, as exact DDP makes any world size (tests/e2e/test_ddp_exact.py). The batch plan, the
global sampler, its ledger and the reseeding, in process: tests/unit/test_elastic_plan.py. (A
node lost for good under torchrun's elastic rendezvous: tests/system/test_multinode_faults.py.)
"""

import json
from pathlib import Path

from support.outputs import read_metrics
from support.runs import launch, tiny_overrides, together, train, trainer_command
from support.weights import compare_weights, weights

STEPS = 56
# A global batch of 12, which 1, 2, 3 (and 4) ranks all divide: 50 steps per epoch.
OPTIONS = {"train.global_batch": 12, "train.batch_size": 6, "train.max_steps": STEPS, "checkpoint.every": 10}


def state(output_dir: Path, step: int) -> dict:
    return json.loads((output_dir / "checkpoints" / f"step-{step}" / "state.json").read_text())


def logged_losses(output_dir: Path) -> dict[int, float]:
    """The loss of each log step; a step logged again after a resume counts as relogged."""
    return {line["step"]: line["loss"] for line in read_metrics(output_dir) if "loss" in line}


def assert_resumed(output: str, output_dir: Path, saved: dict, world_size: int) -> None:
    """The run resumed the checkpoint whose state.json is `saved`, at `world_size`, with
    the checkpoint's ledger reproduced."""
    step, ledger = saved["step"], saved["data"]["ledger"]
    assert f"resumed from {output_dir / 'checkpoints' / f'step-{step}'}" in output, output[-3000:]
    assert f"resumed at world size {world_size} from a checkpoint of world size {saved['world_size']}" in output
    assert f"data position verified: epoch 0, {step * 12} samples consumed (ledger {ledger[:12]})" in output


def test_a_run_shrinks_to_one_rank_then_grows_to_three_on_the_same_global_batches(tiny_model, reviews, tmp_path):
    """One config, three world sizes, global batch 12: 2 ranks are SIGKILLed mid-epoch at step
    23; one plain process resumes step 20 (1 x 6 x 2 micro-batches) and is SIGKILLed at step
    33; 3 ranks resume step 30 (3 x 4) and finish after the epoch boundary (50 steps). Each
    resume verifies the data position. Against the uninterrupted 2-rank run: the weights
    within 1e-5, and the loss logged at every log step, the redone ones included, within
    1e-5 too (summation order is all that differs). The middle leg is also accumulation in
    one process, held to one big batch."""
    reference = tmp_path / "uninterrupted"
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, reviews, out, **OPTIONS)

    def killed(result, nproc: int | None) -> str:
        # a plain process dies of the signal; torchrun names it in its report
        died = result.returncode == -9 if nproc is None else result.returncode != 0 and "SIGKILL" in result.output
        assert died, result.output[-3000:]
        return result.output

    def killed_at(step: int, nproc: int | None) -> str:
        fault = {"TRAINER_FAULT_SIGKILL": f"0:{step}"}
        return killed(launch(trainer_command(overrides, nproc=nproc), env=fault), nproc)

    # The uninterrupted run and the first leg at once: independent launches.
    first, uninterrupted = together(
        (trainer_command(overrides, nproc=2), {"TRAINER_FAULT_SIGKILL": "0:23"}),
        (trainer_command(tiny_overrides(tiny_model, reviews, reference, **OPTIONS), nproc=2), {}))
    assert uninterrupted.returncode == 0, uninterrupted.output[-3000:]
    killed(first, nproc=2)
    at_20 = state(out, 20)
    assert_resumed(killed_at(33, nproc=None), out, at_20, world_size=1)
    at_30 = state(out, 30)
    assert_resumed(train(overrides, nproc=3).output, out, at_30, world_size=3)

    splits = [(s["world_size"], s["global_batch"], s["micro_batch"], s["grad_accum"])
              for s in (at_20, at_30, state(out, STEPS))]
    assert splits == [(2, 12, 6, 1), (1, 12, 6, 2), (3, 12, 4, 1)]
    assert compare_weights(weights(tiny_model), weights(reference, STEPS)).max_abs > 1e-2
    assert compare_weights(reference, out, STEPS).max_abs <= 1e-5
    expected, resumed = logged_losses(reference), logged_losses(out)
    assert sorted(resumed) == sorted(expected) == list(range(2, STEPS + 1, 2))
    assert max(abs(resumed[step] - expected[step]) for step in expected) <= 1e-5
