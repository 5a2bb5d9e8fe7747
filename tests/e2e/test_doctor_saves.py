"""`python -m trainer doctor` on two ranks with each state a comm hook or strategy adds to a
checkpoint: its save check (trainer/preflight/grace.py) writes them as training would, into
one scratch folder that every rank shares, then removes it. The hook `none` is
tests/system/test_doctor.py's."""

import re

import pytest
from support.runs import failure_output, launch, tiny_overrides, trainer_command

SAVE_TIMED = r"then a save of the model and optimizer \([\d.]+s measured on output_dir's storage\)"


@pytest.mark.parametrize("options", [
    {"ddp.comm_hook": "bf16"},
    {"ddp.comm_hook": "fp16", "model.lora.r": 4},  # LoRA saves what trains alone
    {"ddp.comm_hook": "powersgd"},  # each rank's error feedback: per-rank/rank-N.pt
    {"train.strategy": "fsdp"},  # each rank's shards
], ids=["bf16", "fp16-lora", "powersgd", "fsdp"])
def test_doctor_times_the_save_of_every_rank_s_state(tiny_model, reviews, tmp_path, options):
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, reviews, out, **{"train.batch_size": 4, **options})
    result = launch(trainer_command(overrides, nproc=2, command="doctor"), timeout=240)
    assert result.returncode == 0, failure_output(result.output)
    assert "Traceback" not in result.output
    assert re.search(SAVE_TIMED, result.output), failure_output(result.output)
    assert re.search(r"^doctor: OK", result.output, re.M)
    assert not list(out.glob(".doctor*"))  # the scratch folders are gone, every rank's
