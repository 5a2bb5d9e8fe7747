"""A resume under a changed config: a change that alters the run is refused, naming each key
old -> new, unless checkpoint.allow_changes accepts it, and then it takes effect; keys that
don't alter the run pass freely; a longer run is accepted with a notice. Neither a changed
train.lr (the optimizer's saved param groups hold the old one) nor a changed batch size (the
data position is counted in global batches) may pass unnoticed.
"""

import shutil
from pathlib import Path

import pytest
from support.outputs import read_metrics, read_summary
from support.runs import assert_usage_error, snapshot, tiny_overrides, train

FIRST = {"train.max_steps": 4, "checkpoint.every": 2, "train.log_every": 1}
LONGER = {**FIRST, "train.max_steps": 8}


@pytest.fixture(scope="module")
def first_run(tiny_model, reviews, tmp_path_factory) -> Path:
    """4 steps in one process, checkpoints at 2 and 4: what each case resumes."""
    out = tmp_path_factory.mktemp("first") / "run"
    train(tiny_overrides(tiny_model, reviews, out, **FIRST), nproc=None)
    return out


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


@pytest.mark.parametrize("change, expected", [
    ({"train.lr": 2e-3}, "train.lr: 0.001 -> 0.002"),
    ({"seed": 7}, "seed: 42 -> 7"),
    ({"train.global_batch": 8, "checkpoint.allow_changes": "[train.global_batch]"}, "train.global_batch: 16 -> 8"),
    ({"model.name": "DROPOUT_MODEL"}, "model.name: "),
    ({"train.max_steps": 3}, "train.max_steps: 4 -> 3"),
], ids=["lr", "seed", "global-batch", "model", "shorter"])
def test_a_change_that_alters_the_run_is_refused_naming_the_key(usage_run, first_run, tiny_model, dropout_model,
                                                                 reviews, tmp_path, change, expected):
    out = copy_of(first_run, tmp_path)
    before = snapshot(out)
    change = {k: dropout_model if v == "DROPOUT_MODEL" else v for k, v in change.items()}
    result = usage_run(tiny_overrides(tiny_model, reviews, out, **{**LONGER, **change}))
    assert_usage_error(result, f"checkpoint.resume: {out / 'checkpoints' / 'step-4'} was written with another config: ")
    assert expected in result.output and "checkpoint.allow_changes" in result.output
    assert snapshot(out) == before  # nothing trained, nothing written


def test_accepted_changes_take_effect_and_free_keys_pass(first_run, tiny_model, reviews, tmp_path):
    """lr doubled (allowed), max_steps 4 -> 8 (a longer run), log_every 1 -> 2 (free). The
    logged lr after the resume is the new lr on the schedule rebuilt for 8 steps."""
    out = copy_of(first_run, tmp_path)
    result = train(tiny_overrides(tiny_model, reviews, out, **{
        **LONGER, "train.lr": 2e-3, "train.log_every": 2, "checkpoint.allow_changes": "[train.lr]"}), nproc=None)
    assert "resuming with a changed config: train.lr: 0.001 -> 0.002" in result.output
    assert "resuming with a changed config: train.max_steps: 4 -> 8" in result.output
    assert "log_every" not in result.output
    logged = {line["step"]: line["lr"] for line in read_metrics(out) if "lr" in line}
    warmup = round(0.1 * 8)  # tiny_overrides' warmup_ratio
    assert sorted(s for s in logged if s > 4) == [6, 8]
    for step in (6, 8):  # the lr for the next step, after this step's scheduler.step()
        assert logged[step] == pytest.approx(2e-3 * (8 - step) / (8 - warmup), rel=1e-12, abs=1e-15)
    assert read_summary(out)["resumed_from_step"] == 4


def test_a_resume_on_other_data_is_refused_by_the_ledger(usage_run, first_run, tiny_model, reviews, tmp_path):
    """The data moved (data.path accepted by allow_changes), but its rows came back in another
    order: the 64 samples the checkpoint consumed are not the ones this data has at those
    positions. The config can't tell; the ledger does, before the first step."""
    out = copy_of(first_run, tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    rows = (reviews / "train.jsonl").read_text().splitlines(keepends=True)
    (moved / "train.jsonl").write_text("".join(reversed(rows)))
    shutil.copy(reviews / "test.jsonl", moved)
    before = snapshot(out)
    result = usage_run(tiny_overrides(tiny_model, moved, out, **{**LONGER, "checkpoint.allow_changes": "[data.path]"}))
    assert_usage_error(result, f"checkpoint.resume: {out / 'checkpoints' / 'step-4'}: the data position does not "
                               "reproduce: the checkpoint consumed 64 samples of epoch 0")
    assert snapshot(out) == before


def test_a_resume_whose_labels_differ_is_refused_before_the_model_loads(usage_run, first_run, tiny_model, reviews,
                                                                        tmp_path):
    """Other class names, even where checkpoint.allow_changes accepts the key: each class's id
    and the head are the checkpoint's. Refused in one line, nothing written, before any weight
    loads: the model here has weights no one could load."""
    out = copy_of(first_run, tmp_path)
    before = snapshot(out)
    unloadable = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    (unloadable / "model.safetensors").write_bytes(b"not weights")
    result = usage_run(tiny_overrides(unloadable, reviews, out, **{
        **LONGER, "data.label_names": "[a,b,c,d,e]", "checkpoint.allow_changes": "[data.label_names,model.name]"}))
    assert_usage_error(result, "the labels changed from the checkpoint's to what this run's data and config give: "
                               "names: (")
    assert "-> (a, b, c, d, e): resume with the data and labels the run was started on" in result.output
    assert snapshot(out) == before
