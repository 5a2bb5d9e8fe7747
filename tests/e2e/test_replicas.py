"""A replica that drifts (silent data corruption) is found, named and kept out of every
checkpoint: TRAINER_FAULT_CORRUPT flips the lowest bit of one weight on one rank, after its
step 6's optimizer step. Nothing fails, and the loss barely moves; the comparison before step
8's save finds it, within one fault.fingerprint_every (5), and the job exits 76 (node fault)
with the odd rank's host named to the launcher, step 8 unsaved.

Every other 2-rank run of the suite compares its replicas before each save too (on by
default): exact DDP, PowerSGD, sparse embedding gradients and LoRA keep them bitwise equal."""

from __future__ import annotations

import socket

from conftest import tiny_overrides, together, trainer_command

from trainer.exit_codes import NODE_FAULTS_ENV, Exit

SETTINGS = {"train.batch_size": 4, "train.max_steps": 30, "checkpoint.every": 4, "fault.fingerprint_every": 5}


def complete_steps(output_dir) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (output_dir / "checkpoints").glob("step-*/COMPLETE"))


def test_a_replica_that_drifts_is_named_by_the_majority_and_ends_the_job_76_unsaved(tiny_model, reviews, tmp_path):
    three, two = tmp_path / "three", tmp_path / "two"
    runs = together(*((trainer_command(tiny_overrides(tiny_model, reviews, out / "run", **SETTINGS), nproc),
                       {"TRAINER_FAULT_CORRUPT": f"{odd}:6", NODE_FAULTS_ENV: str(out / "suspects")})
                      for out, nproc, odd in ((three, 3, 2), (two, 2, 1))))
    host = socket.gethostname()
    for out, run in zip((three, two), runs, strict=True):
        assert run.returncode == Exit.NODE_FAULT, run.output[-4000:]
        assert complete_steps(out / "run") == [4], run.output[-4000:]  # never saved from diverged weights
        assert set((out / "suspects").read_text().split()) == {host}
    # The corrupted weight is the model's first, the word embeddings; its optimizer state
    # (step, moments) stays equal, as the all-reduced gradients keep it.
    three_ranks, two_ranks = (run.output for run in runs)
    first = "1 of 164 tensors differ, the first bert.embeddings.word_embeddings.weight"
    assert (f"the replicas diverged by step 8: rank 2 on {host} ({first}) holds another state than ranks 0, 1. "
            "Exact DDP keeps them bitwise equal: most likely silent data corruption") in three_ranks, \
        three_ranks[-4000:]
    assert (f"the replicas diverged by step 8: ranks 0, 1 on {host} hold 2 different states, none held by a majority "
            f"(rank 0 and rank 1: {first})") in two_ranks, two_ranks[-4000:]
    assert f"node fault: suspect {host}" in three_ranks
