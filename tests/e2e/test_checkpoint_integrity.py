"""Checkpoints a run can trust: damaged ones are skipped by name, failed saves harm nothing.

Every case starts from the same uninterrupted run (checkpoints at steps 4, 6 and 8), damages
it the way disks and schedulers do, relaunches the same command, and asserts where it resumed
from, what it warned about, and that its final weights are bitwise those of the
uninterrupted run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.outputs import read_summary
from support.runs import launch, locally, tiny_overrides, train, trainer_command
from support.weights import compare_weights, weights

from trainer.checkpoint.store import verify

STEPS = 8


OPTIONS = {"train.max_steps": STEPS, "checkpoint.every": 2, "checkpoint.keep": 3}


def overrides(tiny_model, reviews, output_dir, **extra):
    return tiny_overrides(tiny_model, reviews, output_dir, **{**OPTIONS, **extra})


@pytest.fixture(scope="module")
def uninterrupted(reference_run, tiny_model) -> Path:
    out = reference_run(locally(None), tiny_model, **OPTIONS).run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-6", "step-8"]
    return out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, resumed_from, warnings", [
    ({"step-8/optimizer.pt": flip_byte}, 6, ["step-8: optimizer.pt does not match its checksum"]),
    ({"step-8/COMPLETE": Path.unlink}, 6, ["step-8: no completion marker"]),
    # two in a row: a file missing, and one truncated
    ({"step-8/rng.pt": Path.unlink, "step-6/model.safetensors": truncate}, 4,
     ["step-8: rng.pt is missing", "step-6: model.safetensors does not match its checksum"]),
], ids=["flipped-byte", "no-marker", "two-bad"])
def test_damaged_checkpoint_is_skipped_by_name(uninterrupted, tiny_model, reviews, tmp_path,
                                               damage, resumed_from, warnings):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    for name, hurt in damage.items():
        hurt(out / "checkpoints" / name)

    result = train(overrides(tiny_model, reviews, out), nproc=None)
    for warning in warnings:
        assert f"skipping checkpoint {out / 'checkpoints'}/{warning}" in result.output
    assert read_summary(out)["resumed_from_step"] == resumed_from
    assert not compare_weights(uninterrupted, out, STEPS).differing
    assert verify(out / "checkpoints" / "step-8") is None  # rewritten whole


def test_pruning_never_deletes_the_last_good_checkpoint(uninterrupted, tiny_model, reviews, tmp_path):
    """keep=1 after falling back past two damaged checkpoints: the newer damaged step-8 must
    not count as "the newest", or pruning would delete the step-6 just written."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    flip_byte(out / "checkpoints/step-6/model.safetensors")
    flip_byte(out / "checkpoints/step-8/model.safetensors")
    settings = overrides(tiny_model, reviews, out, **{"checkpoint.keep": 1, "checkpoint.every": 3})

    killed = launch(trainer_command(settings, nproc=None), env={"TRAINER_FAULT_SIGKILL": "0:7"})
    assert killed.returncode != 0
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[0] == "abandoned-step-8" or names[0].startswith("abandoned-step-8-"), names
    assert names[1:] == ["step-6"] and verify(out / "checkpoints/step-6") is None

    train(settings, nproc=None)
    assert read_summary(out)["resumed_from_step"] == 6
    assert not compare_weights(uninterrupted, out, STEPS).differing


# FSDP's synchronous saves raise DCP's failures through the same path as its async ones
# (formats.dcp_failures), which this covers with the background write's extra steps.
@pytest.mark.parametrize("strategy, async_save", [("ddp", False), ("ddp", True), ("fsdp", True)],
                         ids=["sync", "async", "fsdp-async"])
def test_disk_full_mid_save_keeps_the_previous_checkpoint(uninterrupted, tiny_model, reviews, tmp_path, strategy,
                                                          async_save):
    """A real ENOSPC: output_dir on a tmpfs with room for one checkpoint. Both ranks fail with
    the same message (a background write's failure too, FSDP's shards' included; torchrun
    may end the slower rank before it prints), the previous checkpoint still verifies, no
    partial folder is left, and with room again the job resumes from it to the same weights."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    checkpoint_bytes = sum(f.stat().st_size for f in (uninterrupted / "checkpoints/step-4").iterdir())
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(checkpoint_bytes * 1.6)}", "tmpfs", mount],
                   check=True)
    try:
        out = mount / "run"
        settings = overrides(tiny_model, reviews, out, **{"checkpoint.keep": 2, "checkpoint.every": 4,
                                                       "train.batch_size": 8,  # 2 x 8 = 1 x 16
                                                       "checkpoint.async_save": async_save,
                                                       "train.strategy": strategy,
                                                       "ddp.sparse_embedding_grad": strategy == "ddp"})
        full = launch(trainer_command(settings, nproc=2))
        assert full.returncode != 0
        error = re.compile(rf"error: checkpoint step-8: save failed: .* \([0-9.]+ MB free in {out}/checkpoints\)")
        assert len(error.findall(full.output)) in (1, 2), full.output[-3000:]  # rank 0, rank 1 or both
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
        assert verify(out / "checkpoints/step-4") is None

        subprocess.run(["mount", "-o", "remount,size=512M", mount], check=True)
        train(settings, nproc=2)
        assert read_summary(out)["resumed_from_step"] == 4
        two_ranks = weights(out, STEPS)
    finally:
        subprocess.run(["umount", "-l", mount], check=False)
    # 2 ranks x batch b equal 1 process x 2b (the DDP-exactness tests), not bitwise.
    assert compare_weights(weights(uninterrupted, STEPS), two_ranks).max_abs <= 1e-5


def test_sigkill_mid_background_write_resumes_from_the_checkpoint_before(uninterrupted, tiny_model, reviews,
                                                                         tmp_path):
    """The process dies while its background thread writes step 6 (files written, no marker
    yet: a test hook kills it exactly there). Step 6 is not taken for complete; the relaunch
    resumes from step 4, rewrites step 6, and ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    settings = overrides(tiny_model, reviews, out, **{"checkpoint.async_save": True})
    killed = launch(trainer_command(settings, nproc=None), env={"TRAINER_FAULT_SIGKILL_IN_SAVE": "6"})
    assert killed.returncode == -9, killed.output[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [".tmp-step-6", "step-2", "step-4"], names  # torn, unmarked

    result = train(settings, nproc=None)
    assert "(in the background)" in result.output
    assert read_summary(out)["resumed_from_step"] == 4
    assert not compare_weights(uninterrupted, out, STEPS).differing
    assert verify(out / "checkpoints" / "step-6") is None
