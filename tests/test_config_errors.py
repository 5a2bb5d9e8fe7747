"""User mistakes: one line naming the key, exit code 2, no traceback, nothing written.

Table-driven: overrides, config files, data files and launcher environments, each wrong in
one way. Where a run's output_dir already holds an earlier run, it must be byte-for-byte
unchanged afterwards. Each case is a `python -m trainer` process of its own, forked from a
server that has imported the trainer's dependencies once (conftest.usage_run).
"""

import hashlib
import json
from pathlib import Path

import pytest

from conftest import run, tiny_overrides, trainer_command

# (id, extra overrides, text the one-line error must contain)
BAD_OVERRIDES = [
    ("zero-batch", ["train.batch_size=0"], "train.batch_size: must be >= 1"),
    ("unknown-key", ["train.bogus=1"], "train.bogus: unknown key"),
    ("wrong-type", ["train.lr=fast"], "train.lr:"),
    ("bad-choice", ["train.precision=fp8"], "train.precision:"),
    ("bad-device", ["train.device=tpu"], "train.device:"),
    ("cuda-without-cuda", ["train.device=cuda"], "train.device: cuda, but torch.cuda.is_available() is False"),
    ("nccl-on-cpu", ["train.device=cpu", "dist.backend=nccl"], "dist.backend: nccl needs GPUs, and train.device is cpu"),
    ("peak-tflops", ["train.peak_tflops=0"], "train.peak_tflops: must be > 0 or null"),
    # The tiny model has 128 positions: a longer sample would fail mid-epoch, at the lookup.
    ("max-length-beyond-positions", ["data.max_length=512"],
     "data.max_length: 512 is more than the 128 positions of model.name"),
    ("not-key-value", ["train.lr"], "override 'train.lr'"),
    ("missing-data-file", ["data.path=./no/such.jsonl"], "data.path: ./no/such.jsonl"),
    ("missing-model-dir", ["model.name=/no/such/model"], "model.name: /no/such/model"),
    ("bad-resume", ["checkpoint.resume=/no/such/step-3"], "checkpoint.resume"),
    ("text-column", ["data.text_field=body"], "data.text_field: column 'body'"),
    ("labels-out-of-range", ["data.num_labels=3"], "data.num_labels: data.train_split has labels in [0, 4]"),
    ("missing-split", ["data.eval_split=validation"], "data.eval_split"),
    ("negative-lr", ["train.lr=-0.1"], "train.lr: must be in (0, 1)"),
    ("warmup-ratio", ["train.warmup_ratio=1.5"], "train.warmup_ratio: must be in [0, 1)"),
    ("zero-accum", ["train.grad_accum=0"], "train.grad_accum: must be >= 1"),
    ("zero-global-batch", ["train.global_batch=0"], "train.global_batch: must be >= 1 or null"),
    ("accum-and-global-batch", ["train.global_batch=32", "train.grad_accum=2"],
     "train.grad_accum, train.global_batch: set one of them"),
    ("zero-keep", ["checkpoint.keep=0"], "checkpoint.keep: must be >= 1"),
    ("zero-timeout", ["dist.timeout_s=0"], "dist.timeout_s: must be > 0"),
    ("unknown-signal", ["fault.preempt_signals=[SIGTERM,SIGNOPE]"],
     "fault.preempt_signals: 'SIGNOPE' is not a signal that can be caught"),
    ("uncatchable-signal", ["fault.preempt_signals=[SIGKILL]"],
     "fault.preempt_signals: 'SIGKILL' is not a signal that can be caught"),
    ("watchdog-factor", ["fault.slow_step_factor=1"], "fault.slow_step_factor: must be > 1"),
    ("bad-backend", ["dist.backend=mpi"], "dist.backend:"),
    ("bad-wandb-mode", ["wandb.mode=sometimes"], "wandb.mode:"),
    ("unknown-section", ["optimizer.lr=1"], "optimizer"),
    ("label-column", ["data.label_field=stars"], "data.label_field: column 'stars'"),
    ("epochs-and-max-steps", ["train.epochs=2"], "train.max_steps, train.epochs: set exactly one of them (both are set)"),
    ("neither-steps-nor-epochs", ["train.max_steps=null"], "train.max_steps, train.epochs: set exactly one of them (neither"),
    ("eval-every-word", ["train.eval_every=daily"], "train.eval_every: must be a step count >= 0 or `epoch`"),
    ("unknown-best-metric", ["checkpoint.best_metric=f1"], "checkpoint.best_metric: Invalid value 'f1'"),
    ("negative-patience", ["train.early_stopping_patience=-1"], "train.early_stopping_patience: must be >= 0"),
    ("patience-without-metric", ["train.early_stopping_patience=2"],
     "train.early_stopping_patience: needs checkpoint.best_metric"),
    ("best-at-end-without-metric", ["checkpoint.load_best_at_end=true"], "checkpoint.load_best_at_end: needs"),
    ("label-names-count", ["data.label_names=[bad,good]"], "data.label_names: expected 5 distinct names"),
]


def previous_run(out: Path) -> dict[str, str]:
    """An output_dir holding an earlier run's files; returns their checksums."""
    for name, text in {"metrics.jsonl": '{"step": 2}\n', "summary.json": "{}", "config.yaml": "seed: 0\n",
                       "checkpoints/step-2/COMPLETE": "{}", "final/config.json": "{}"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return snapshot(out)


def snapshot(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case, extra, expected", BAD_OVERRIDES, ids=[c[0] for c in BAD_OVERRIDES])
def test_bad_override(usage_run, tiny_model, reviews, tmp_path, case, extra, expected):
    out = tmp_path / "run"
    before = previous_run(out)
    result = usage_run(tiny_overrides(tiny_model, reviews, out, **{"train.max_steps": 2}) + extra)
    assert_usage_error(result, expected)
    assert snapshot(out) == before


GOOD_ROWS = "".join(json.dumps({"text": f"review {i}", "label": i % 5}) + "\n" for i in range(40))
BAD_DATA = [
    ("not-json", GOOD_ROWS + "{not json\n", "JSON parse error"),
    ("empty-file", "", "no rows could be read"),
    ("negative-label", GOOD_ROWS + json.dumps({"text": "x", "label": -1}) + "\n",
     "data.num_labels: data.train_split has labels in [-1, 4]"),
    ("text-labels", GOOD_ROWS.replace('"label": 1}', '"label": "good"}'), "data.label_field: column 'label'"),
    ("null-text", GOOD_ROWS + json.dumps({"text": None, "label": 1}) + "\n",
     "data.text_field: column 'text' in data.train_split has a non-text value in row 40: None"),
]


@pytest.mark.parametrize("case, train_rows, expected", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_data_file(usage_run, tiny_model, tmp_path, case, train_rows, expected):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(train_rows)
    (data / "test.jsonl").write_text(GOOD_ROWS)
    out = tmp_path / "run"
    before = previous_run(out)
    assert_usage_error(usage_run(tiny_overrides(tiny_model, data, out)), expected)
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "content, expected",
    [
        ("train: [1, 2\n", "invalid YAML (line 2)"),
        ("- just\n- a list\n", "expected a mapping"),
        ("data:\n  path: x\n", "model.name: is required but not set"),
        ("train:\n  max_steps: many\n", "train.max_steps:"),
        ("train:\n  batch_size: [16]\n", "train.batch_size:"),
        ("", "model.name: is required but not set"),
        ("trian:\n  lr: 0.1\n", "trian"),
        ("model:\n  name: x\n  name: y\n", "invalid YAML"),
    ],
)
def test_bad_config_file(usage_run, tmp_path, content, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    assert_usage_error(usage_run([], config=str(config)), expected)


def test_missing_config_file(usage_run, tmp_path):
    assert_usage_error(usage_run([], config=str(tmp_path / "nope.yaml")), "nope.yaml: not found")


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK, WORLD_SIZE set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         "RANK=3 is outside WORLD_SIZE=2"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "srun started 4 tasks but RANK/WORLD_SIZE are unset"),
        ({**TORCHRUN_ENV, "LOCAL_RANK": "first"}, "LOCAL_RANK='first' is not an integer"),
        ({**TORCHRUN_ENV, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a valid port"),
        ({**TORCHRUN_ENV, "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
        ({**TORCHRUN_ENV, "LOCAL_RANK": "1"}, "LOCAL_RANK=1 is inconsistent with RANK=0"),
    ],
)
def test_inconsistent_launcher_environment(usage_run, tiny_model, reviews, tmp_path, env, expected):
    """Never a silent world of one: a half-set environment is refused before any rendezvous."""
    out = tmp_path / "run"
    result = usage_run(tiny_overrides(tiny_model, reviews, out), env=env)
    assert_usage_error(result, "environment: " + expected)
    assert not out.exists()


GRANTED_GPUS = [{"SLURM_GPUS_ON_NODE": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": "all"}]


@pytest.mark.parametrize("granted", GRANTED_GPUS, ids=lambda env: next(iter(env)))
def test_granted_gpus_that_cuda_cannot_use_are_an_error_not_a_cpu_run(usage_run, tiny_model, reviews, tmp_path,
                                                                      granted):
    """A GPU job on a node whose driver is too old, or in a container without --gpus, would
    train on CPU hundreds of times slower: refused before the rendezvous, naming the variable
    that shows GPUs, what torch.cuda says and the torch build (a CPU build on this machine)."""
    out = tmp_path / "run"
    result = usage_run(tiny_overrides(tiny_model, reviews, out), env=granted)
    name, value = next(iter(granted.items()))
    assert_usage_error(result, f"train.device: {name}={value} grants this job GPUs, but "
                               "torch.cuda.is_available() is False: torch ")
    assert "CPU-only build (torch.version.cuda is None)" in result.output
    assert "set train.device=cpu dist.backend=gloo" in result.output
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
    result = run(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **{
        "train.device": "cpu", "dist.backend": "gloo", "train.max_steps": 2}), nproc=None),
        env={"SLURM_GPUS_ON_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.output[-3000:]
    assert "on cpu (no process group)" in result.output


def test_dp_refuses_several_ranks(tiny_model, reviews, tmp_path):
    result = run(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **{"train.strategy": "dp"}), nproc=2))
    assert result.returncode != 0
    assert result.output.count("error: train.strategy: dp (nn.DataParallel) runs in one process") == 2


def test_check_prints_resolved_config(usage_run, tiny_model, reviews, tmp_path):
    result = usage_run(tiny_overrides(tiny_model, reviews, tmp_path, **{"train.lr": 3e-4}), command="check",
                       config="configs/demo.yaml")
    assert result.returncode == 0, result.output
    assert "lr: 0.0003" in result.output and f"name: {tiny_model}" in result.output
    assert "${" not in result.output  # interpolations are resolved
    assert not tmp_path.joinpath("config.yaml").exists()


def assert_usage_error(result, expected: str) -> None:
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.output[-3000:]
    assert len(errors) == 1 and expected in errors[0], result.output[-3000:]
    assert "Traceback" not in result.output


def test_strategy_dp_single_process_trains(tiny_model, reviews, tmp_path):
    """dp runs in one process (nn.DataParallel on 2+ GPUs; the bare model on CPU)."""
    result = run(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path, **{"train.strategy": "dp",
                                                                                 "train.max_steps": 3}), nproc=None))
    assert result.returncode == 0, result.output[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 1
