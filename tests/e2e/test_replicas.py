"""A replica that drifts (silent data corruption) is found, named and kept out of every
checkpoint: TRAINER_FAULT_CORRUPT flips the lowest bit of one weight on one rank, after its
step 6's optimizer step. Nothing fails, and the loss barely moves; the comparison before step
8's save finds it, within one fault.fingerprint_every (5), and the job exits 76 (node fault)
with the odd rank's host named to the launcher, step 8 unsaved. Ranks that differ before
the first step loaded different files: that is the setup's mistake, exit 2.

Every other multi-rank run of the suite compares its replicas at its start and before each
save too (on by default): exact DDP, PowerSGD, sparse embedding gradients and LoRA keep them
bitwise equal."""

from __future__ import annotations

import shutil
import socket

from support.outputs import complete_steps
from support.runs import tiny_overrides, together, trainer_command

from trainer.exit_codes import NODE_FAULTS_ENV, Exit

SETTINGS = {"train.batch_size": 4, "train.max_steps": 30, "checkpoint.every": 4, "fault.fingerprint_every": 5}
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.dropout": 0.0}


def another_revision(model, folder):
    """A copy of `model` whose layer-0 query bias differs: the same model, another revision."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(name for name in weights if "layer.0.attention.self.query.bias" in name)
    weights[name] = weights[name] + 1.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_drifting_replica_is_named_and_ends_the_job_76_unsaved_and_ranks_that_start_apart_exit_2(
        tiny_model, reviews, tmp_path):
    three, two, apart = tmp_path / "three", tmp_path / "two", tmp_path / "apart"
    # Each node its own copy of model.name, one of them another revision: under LoRA the frozen
    # base is loaded by every rank, and DDP broadcasts only what trains.
    shutil.copytree(tiny_model, tmp_path / "models" / "rank0")
    another_revision(tiny_model, tmp_path / "models" / "rank1")
    per_rank = tiny_overrides(tmp_path / "models" / "rank${oc.env:LOCAL_RANK}", reviews, apart / "run",
                              **SETTINGS, **LORA)
    *drifted, started_apart = together(
        *((trainer_command(tiny_overrides(tiny_model, reviews, out / "run", **SETTINGS), nproc),
           {"TRAINER_FAULT_CORRUPT": f"{odd}:6", NODE_FAULTS_ENV: str(out / "suspects")})
          for out, nproc, odd in ((three, 3, 2), (two, 2, 1))),
        (trainer_command(per_rank, 2), {}))
    host = socket.gethostname()
    for out, run in zip((three, two), drifted, strict=True):
        assert run.returncode == Exit.NODE_FAULT, run.output[-4000:]
        assert complete_steps(out / "run") == [4], run.output[-4000:]  # never saved from diverged weights
        assert set((out / "suspects").read_text().split()) == {host}
    # The corrupted weight is the model's first, the word embeddings; its optimizer state
    # (step, moments) stays equal, as the all-reduced gradients keep it.
    three_ranks, two_ranks = (run.output for run in drifted)
    first = "1 of 164 tensors differ, the first bert.embeddings.word_embeddings.weight"
    assert (f"the replicas diverged by step 8: rank 2 on {host} ({first}) holds another state than ranks 0, 1. "
            "Exact DDP keeps them bitwise equal: most likely silent data corruption") in three_ranks, \
        three_ranks[-4000:]
    assert (f"the replicas diverged by step 8: ranks 0, 1 on {host} hold 2 different states, none held by a majority "
            f"(rank 0 and rank 1: {first})") in two_ranks, two_ranks[-4000:]
    assert f"node fault: suspect {host}" in three_ranks

    # One line on each rank, the same, and no traceback: exit 2.
    errors = [line for line in started_apart.output.splitlines() if line.startswith("error: ")]
    assert started_apart.returncode == Exit.USAGE and len(errors) == 2 and len(set(errors)) == 1, \
        started_apart.output[-4000:]
    assert errors[0].startswith("error: the ranks start from different weights: ranks 0, 1 on ")
    assert errors[0].endswith("(rank 0 and rank 1: 1 of 51 tensors differ, the first base_model.model.bert.encoder."
                              "layer.0.attention.self.query.base_layer.bias). Every node must load the same "
                              "model.name (the same files, the same revision) and the same checkpoint")
    assert "Traceback" not in started_apart.output
