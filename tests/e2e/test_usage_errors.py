"""The CLI's contract for a user mistake: one `error:` line naming the key, exit code 2, no
traceback, nothing written to output_dir, and on every rank, before the rendezvous.

A few mistakes of each kind prove the contract as `python -m trainer` runs: an override, a
config file, the launcher's environment, the world size; every other mistake of those kinds
is tests/unit/test_config_errors.py's, checked in process. The mistakes here that only real
data or a model show are each a run of their own. Each case is a `python -m trainer` process
of its own, forked from a server that has imported the trainer's dependencies once
(conftest's usage_run fixture); those that run under torchrun, or train, start afresh.
"""

import json
import re
import shutil

import pytest
import yaml
from support.outputs import read_summary
from support.runs import REPO, assert_usage_error, launch, previous_run, snapshot, tiny_overrides, trainer_command

from trainer.exit_codes import Exit

# id: (extra overrides, text the one-line error must contain)
BAD_OVERRIDES = {
    "unknown-key": (["train.bogus=1"], "train.bogus: unknown key"),  # the config's, for the contract
    # The tiny model has 128 positions: a longer sample would fail mid-epoch, at the lookup.
    "max-length-beyond-positions": (["data.max_length=512"],
                                    "data.max_length: 512 is more than the 128 positions of model.name"),
    "text-column": (["data.text_field=body"], "data.text_field: column 'body'"),
    "labels-out-of-range": (["data.num_labels=3"], "data.num_labels: data.train_split has labels in [0, 4]"),
    "missing-split": (["data.train_split=training"], "data.train_split: 'training' is not a split of"),
    "missing-test-split": (["data.test_split=validation"], "data.test_split: 'validation' is not a split of"),
    "label-type": (["data.problem_type=multi_label"], "column 'label' in data.train_split holds ids, not lists"),
    "label-column": (["data.label_field=stars"], "data.label_field: column 'stars'"),
}


@pytest.mark.parametrize("command", ["train", "check"])
@pytest.mark.parametrize("case, extra, expected", [(case, *args) for case, args in BAD_OVERRIDES.items()],
                         ids=list(BAD_OVERRIDES))
def test_bad_override(usage_run, tiny_model, reviews, tmp_path, case, extra, expected, command):
    """The same one line from check, before a node is taken, as from train."""
    out = tmp_path / "run"
    before = previous_run(out)
    result = usage_run(tiny_overrides(tiny_model, reviews, out, **{"train.max_steps": 2}) + extra, command=command)
    assert_usage_error(result, expected)
    assert snapshot(out) == before


GOOD_ROWS = "".join(json.dumps({"text": f"review {i}", "label": i % 5}) + "\n" for i in range(40))
BAD_DATA = [
    ("not-json", GOOD_ROWS + "{not json\n", "train.jsonl: line 41 is not valid JSON"),
    ("empty-file", "", "no rows could be read"),
    ("negative-label", GOOD_ROWS + json.dumps({"text": "x", "label": -1}) + "\n",
     "data.num_labels: data.train_split has labels in [-1, 4]"),
    ("text-labels", GOOD_ROWS.replace('"label": 1}', '"label": "good"}'), "data.label_field: column 'label'"),
    ("null-text", GOOD_ROWS + json.dumps({"text": None, "label": 1}) + "\n",
     "1 row cannot train: 1 with no text in column 'text' (row 40); fix them, or set data.drop_invalid_rows=true"),
    ("fractional-labels", GOOD_ROWS.replace('"label": 1}', '"label": 1.5}'),
     ("holds numbers that are not class ids (1.5 in row 1): single_label needs class ids (integers) or names "
     "(strings); for a number to predict, set data.problem_type=regression")),
    ("missing-label", GOOD_ROWS + json.dumps({"text": "x", "label": None}) + "\n",
     "1 row cannot train: 1 with no label in column 'label' (row 40); fix them, or set data.drop_invalid_rows"),
]


@pytest.mark.parametrize("command", ["train", "check"])
@pytest.mark.parametrize("case, train_rows, expected", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_data_file(usage_run, tiny_model, tmp_path, case, train_rows, expected, command):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(train_rows)
    (data / "test.jsonl").write_text(GOOD_ROWS)
    out = tmp_path / "run"
    before = previous_run(out)
    assert_usage_error(usage_run(tiny_overrides(tiny_model, data, out), command=command), expected)
    assert snapshot(out) == before


GOOD_PAIRS = "".join(json.dumps({"prompt": "How was it?", "chosen": f"Good {i}.", "rejected": f"Bad {i}."}) + "\n"
                     for i in range(40))
LONG = " ".join(["the food was great"] * 30)
BAD_PAIRS = [
    ("no-rejected-column", GOOD_PAIRS.replace('"rejected"', '"worse"'),
     "data.rejected_field: column 'rejected' not in data.train_split (columns: prompt, chosen, worse)"),
    ("a-number-for-an-answer", GOOD_PAIRS.replace('"Good 3."', "3").replace('"Good ', '"'),
     "data.chosen_field: column 'chosen' in data.train_split holds"),
    ("empty-answer", GOOD_PAIRS.replace('"Bad 7."', '""'), "1 row cannot train: 1 with no text in column 'rejected'"),
    ("a-message-without-content", GOOD_PAIRS.replace('"chosen": "Good 2."', '"chosen": [{"role": "user"}]').replace(
        '"chosen": "Good ', '"chosen": [{"role": "user", "content": "Good"}], "x": "'),
     "data.chosen_field: column 'chosen' in data.train_split has a message with no content in row 2"),
    ("the-same-once-truncated", GOOD_PAIRS + json.dumps({"prompt": "How?", "chosen": LONG + " yes",
                                                         "rejected": LONG + " no"}) + "\n",
     ("1 with chosen and rejected the same once cut to data.max_length=64 tokens at their end (raise it, or set "
     "data.truncation_side=left) (row 40)")),
]


@pytest.mark.parametrize("command", ["train", "check"])
@pytest.mark.parametrize("case, train_rows, expected", BAD_PAIRS, ids=[c[0] for c in BAD_PAIRS])
def test_bad_preference_pairs(usage_run, tiny_model, tmp_path, case, train_rows, expected, command):
    """data.problem_type=pairwise: each kind of pair that cannot train, one line before any
    weights load (the identical ones once the tokenizer has truncated them)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(train_rows)
    (data / "test.jsonl").write_text(train_rows)  # the same columns: `datasets` reads a folder's files as one
    out = tmp_path / "run"
    before = previous_run(out)
    overrides = tiny_overrides(tiny_model, data, out, **{"data.problem_type": "pairwise", "data.num_labels": "null"})
    assert_usage_error(usage_run(overrides, command=command), expected)
    assert snapshot(out) == before


def test_a_validation_label_that_train_never_saw_stops_check_and_train_alike(usage_run, tiny_model, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    names = ["negative", "positive"]
    rows = [json.dumps({"text": f"review {i}", "label": names[i % 2]}) for i in range(40)]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    (data / "test.jsonl").write_text("\n".join([*rows[:6], json.dumps({"text": "meh", "label": "mixed"})]) + "\n")
    for command in ("check", "train"):
        result = usage_run(tiny_overrides(tiny_model, data, tmp_path / "run", **{"data.num_labels": "null"}),
                           command=command)
        assert_usage_error(result, "data.label_field: column 'label' in data.eval_split has 'mixed' in row 6, which "
                                   "is not one of the labels from the train split (negative, positive)")
    assert not (tmp_path / "run").exists()


def test_bad_config_file(usage_run, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("train: [1, 2\n")
    assert_usage_error(usage_run([], config=str(config)), "invalid YAML (line 2)")


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_inconsistent_launcher_environment(usage_run, tiny_model, reviews, tmp_path):
    """Never a silent world of one: a half-set environment is refused before any rendezvous."""
    out = tmp_path / "run"
    result = usage_run(tiny_overrides(tiny_model, reviews, out), env={"RANK": "0", "WORLD_SIZE": "2"})
    assert_usage_error(result, "environment: RANK, WORLD_SIZE set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing")
    assert not out.exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_rank_refuses_granted_gpus_before_the_rendezvous(usage_run, tiny_model, reviews, tmp_path, rank):
    """Each rank of a torchrun job decides alone, before it would wait for its peers: here
    with nobody at MASTER_ADDR, a rank that went on to the rendezvous would hang there."""
    env = {**TORCHRUN_ENV, "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "9",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    result = usage_run(tiny_overrides(tiny_model, reviews, tmp_path / "run"), env=env, timeout=60)
    assert_usage_error(result, "train.device: CUDA_VISIBLE_DEVICES=0,1 grants this job GPUs")
    assert not (tmp_path / "run").exists()


def test_a_global_batch_the_world_size_cannot_split_is_refused_before_the_rendezvous(usage_run, tiny_model, reviews,
                                                                                      tmp_path):
    """Rank 2 of 3, with nobody at MASTER_ADDR: a rank that went on to the rendezvous would
    hang there. 16 samples per step can't be dealt evenly to 3 ranks."""
    env = {**TORCHRUN_ENV, "RANK": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "3",
           "MASTER_PORT": "9"}
    result = usage_run(tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"train.global_batch": 16}), env=env,
                       timeout=60)
    assert_usage_error(result, "train.global_batch: 16 samples per step cannot be split evenly over world size 3")
    assert not (tmp_path / "run").exists()


def test_cpu_on_purpose_trains_where_gpus_are_granted(tiny_model, reviews, tmp_path):
    result = launch(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **{
        "train.device": "cpu", "dist.backend": "gloo", "train.max_steps": 2}), nproc=None),
        env={"SLURM_GPUS_ON_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.output[-3000:]
    assert "on cpu (no process group)" in result.output


def test_dp_refuses_several_ranks(tiny_model, reviews, tmp_path):
    """Under torchrun, 2 ranks. Each refuses as it starts, but torchrun ends the other rank
    as soon as one has exited, maybe before it printed: the line is there once or twice. The
    launch exits 2, as one process would: a launcher must not retry it (docs/restarts.md)."""
    out = tmp_path / "run"
    result = launch(trainer_command(tiny_overrides(tiny_model, reviews, out, **{"train.strategy": "dp"}), nproc=2))
    assert result.returncode == Exit.USAGE, result.output[-3000:]
    assert result.output.count("error: train.strategy: dp (nn.DataParallel) runs in one process") in (1, 2), \
        result.output[-3000:]
    assert not out.exists()


def test_check_prints_its_report_on_one_screen_and_the_resolved_config_when_asked(usage_run, tiny_model, reviews,
                                                                                  tmp_path):
    overrides = [*tiny_overrides(tiny_model, reviews, tmp_path, **{"train.lr": 3e-4}), "gpu_gib=40"]
    report = usage_run(overrides, command="check", config="configs/demo.yaml")
    assert report.returncode == 0, report.output
    lines = report.output.splitlines()
    # The report alone: no config, the world size said once, and where it comes from.
    assert "lr: 0.0003" not in report.output and len(lines) < 25, report.output
    assert lines[0] == "world size 2 (from dist.world_size)", report.output  # configs/demo.yaml runs on 2
    assert report.output.count("world size") == 1 + report.output.count("(world size 2)"), report.output
    assert "memory plan per rank on a GPU with native bf16: micro-batch 16 x 64 tokens, compute in fp32" \
        in report.output
    assert lines[-1] == "the resolved config: check --resolved prints it as YAML"
    unset = usage_run([*overrides, "dist.world_size=null"], command="check", config="configs/demo.yaml")
    assert unset.output.splitlines()[0] == ("world size 8 (assumed: one node of 8 GPUs; set dist.world_size or "
                                            "check's world_size=N)"), unset.output

    result = usage_run([*overrides, "--resolved"], command="check", config="configs/demo.yaml")
    assert result.returncode == 0, result.output
    assert "lr: 0.0003" in result.output and f"name: {tiny_model}" in result.output
    assert "${" not in result.output  # interpolations are resolved
    assert not tmp_path.joinpath("config.yaml").exists()
    # The plan follows as YAML comments: the output is still the config.
    assert yaml.safe_load(result.output)["train"]["lr"] == 3e-4
    assert "# memory plan per rank on a GPU with native bf16: micro-batch 16 x 64 tokens, compute in fp32" \
        in result.output
    assert re.search(r"^#   fits in 40.00 GiB \(36.00 GiB after 10% headroom\); the largest micro-batch that fits: "
                     r"\d+ \(train.batch_size 16\)$", result.output, re.M), result.output


def test_the_8b_example_fits_an_80_gib_gpu_from_its_config_json_alone(usage_run):
    """configs/llama8b_lora.yaml, planned from the shipped config.json of Llama-3.1-8B (no
    weights, no tokenizer): LoRA over a bf16 base fits an 80 GiB GPU; a full fine-tune doesn't."""
    shape = ["model.name=configs/models/llama-3.1-8b", "--no-data"]  # its data is on the Hub: not here
    lora = usage_run(shape, command="check", config="configs/llama8b_lora.yaml")
    assert lora.returncode == 0, lora.output[-3000:]
    assert "7,504,924,672 frozen in bf16" in lora.output
    # docs/memory.md shows this plan, as printed.
    documented = re.search(r"\n(memory plan per rank.*?\n)```", (REPO / "docs" / "memory.md").read_text(), re.S)
    assert documented and documented.group(1) in lora.output
    assert re.search(r"^  fits in 80.00 GiB .*the largest micro-batch that fits: \d+ \(train.batch_size 4\)$",
                     lora.output, re.M), lora.output[-2000:]
    full = usage_run([*shape, "model.lora.r=null"], command="check", config="configs/llama8b_lora.yaml")
    assert full.returncode == 0 and "  does NOT fit in 80.00 GiB" in full.output, full.output[-2000:]


def test_the_8b_full_fsdp_example_fits_when_sharded_over_16_gpus(usage_run):
    """configs/llama8b_full_fsdp.yaml: every weight trains, 1/16 of each per GPU fits 80 GiB;
    on one GPU (world_size=1) the same run does not."""
    shape = ["model.name=configs/models/llama-3.1-8b", "--no-data"]  # its data is on the Hub: not here
    sharded = usage_run([*shape, "world_size=16"], command="check", config="configs/llama8b_full_fsdp.yaml")
    assert sharded.returncode == 0, sharded.output[-3000:]
    assert "1/16 of each on this rank (FSDP)" in sharded.output and "  fits in 80.00 GiB" in sharded.output
    whole = usage_run([*shape, "world_size=1"], command="check", config="configs/llama8b_full_fsdp.yaml")
    assert whole.returncode == 0 and "  does NOT fit in 80.00 GiB" in whole.output, whole.output[-2000:]


def test_check_at_the_launchs_world_size_refuses_a_global_batch_it_cannot_split(usage_run, tiny_model, reviews,
                                                                                 tmp_path):
    """The launchers pass their world size to `check` (ddp.sh, submit.py, trainer.cli.torchrun):
    a global batch every rank would refuse after the rendezvous is one line before it; `check`
    without one plans for 8 ranks and only warns."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"train.global_batch": 8})
    assert_usage_error(usage_run([*overrides, "world_size=3"], command="check"),
                       "train.global_batch: 8 samples per step cannot be split evenly over world size 3")
    assert usage_run([*overrides, "world_size=2"], command="check").returncode == 0


def test_positions_are_checked_before_any_weight_loads(usage_run, tiny_model, reviews, tmp_path):
    """config.json alone decides data.max_length: a model folder whose weights are not
    readable still answers with the positions, in train and in check."""
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    for command in ("train", "check"):
        result = usage_run(tiny_overrides(broken, reviews, tmp_path / "run", **{"data.max_length": 512}),
                           command=command)
        assert_usage_error(result, "data.max_length: 512 is more than the 128 positions of model.name")


def test_strategy_dp_single_process_trains(tiny_model, reviews, tmp_path):
    """dp runs in one process (nn.DataParallel on 2+ GPUs; the bare model on CPU)."""
    result = launch(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **{"train.strategy": "dp",
                                                                                    "train.max_steps": 3}), nproc=None))
    assert result.returncode == 0, result.output[-3000:]
    assert read_summary(tmp_path)["world_size"] == 1
