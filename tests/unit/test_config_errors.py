"""User mistakes, refused with one line naming the key.

Table-driven: overrides, config files and launcher environments, each wrong in one way,
checked in process by what `python -m trainer train` runs before its rendezvous:
trainer.cli.run_config.load, then trainer.cli.main.train_preflight on the launch environment (a
mapping here, os.environ in a run). That the CLI prints such an error as one `error:` line,
exits 2 with no traceback and writes nothing, on every rank, is tests/e2e/test_usage_errors.py's,
with the mistakes only real data or a model show.
"""

from __future__ import annotations

import pytest
from support.runs import tiny_overrides

from trainer.cli import run_config
from trainer.cli.main import train_preflight
from trainer.errors import ConfigError, TrainerError


def refusal(overrides: list[str], config_file: str | None = None, environ: dict[str, str] | None = None) -> str:
    """The message `python -m trainer train` would refuse to start with (its `error:` line),
    from the checks it runs before the rendezvous; fails if they all pass."""
    with pytest.raises(TrainerError) as refused:
        train_preflight(run_config.load(config_file, overrides), environ or {})
    message = str(refused.value)
    assert "\n" not in message, message  # the CLI prints it as one line
    return message


# (id, extra overrides, text the one-line error must contain)
BAD_OVERRIDES = [
    ("zero-batch", ["train.batch_size=0"], "train.batch_size: must be >= 1"),
    ("unknown-key", ["train.bogus=1"], "train.bogus: unknown key"),
    ("wrong-type", ["train.lr=fast"], "train.lr:"),
    ("bad-choice", ["train.precision=fp8"], "train.precision:"),
    ("bad-device", ["train.device=tpu"], "train.device:"),
    ("cuda-without-cuda", ["train.device=cuda"], "train.device: cuda, but torch.cuda.is_available() is False"),
    ("nccl-on-cpu", ["train.device=cpu", "dist.backend=nccl"],
     "dist.backend: nccl needs GPUs, and train.device is cpu"),
    ("peak-tflops", ["train.peak_tflops=0"], "train.peak_tflops: must be > 0 or null"),
    ("not-key-value", ["train.lr"], "override 'train.lr'"),
    ("missing-data-file", ["data.path=./no/such.jsonl"], "data.path: ./no/such.jsonl"),
    ("missing-model-dir", ["model.name=/no/such/model"], "model.name: /no/such/model"),
    ("bad-resume", ["checkpoint.resume=/no/such/step-3"], "checkpoint.resume"),
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
    ("spike-factor", ["fault.spike_factor=0.5"], "fault.spike_factor: must be 0 (off) or above 1"),
    ("rollback-on-spike-without-check", ["fault.rollback_on_spike=true", "fault.max_bad_steps=0"],
     "fault.rollback_on_spike: needs fault.max_bad_steps > 0 and fault.spike_factor > 0"),
    ("bad-backend", ["dist.backend=mpi"], "dist.backend:"),
    ("bad-wandb-mode", ["wandb.mode=sometimes"], "wandb.mode:"),
    ("unknown-section", ["optimizer.lr=1"], "optimizer"),
    ("epochs-and-max-steps", ["train.epochs=2"],
     "train.max_steps, train.epochs: set exactly one of them (both are set)"),
    ("neither-steps-nor-epochs", ["train.max_steps=null"],
     "train.max_steps, train.epochs: set exactly one of them (neither"),
    ("eval-every-word", ["train.eval_every=daily"], "train.eval_every: must be a step count >= 0 or `epoch`"),
    ("unknown-best-metric", ["checkpoint.best_metric=f1"],
     "checkpoint.best_metric: f1 is not a metric of data.problem_type=single_label (accuracy, f1_macro, loss)"),
    ("another-tasks-metric", ["checkpoint.best_metric=mse"],
     "checkpoint.best_metric: mse is not a metric of data.problem_type=single_label (accuracy, f1_macro, loss)"),
    ("negative-patience", ["train.early_stopping_patience=-1"], "train.early_stopping_patience: must be >= 0"),
    ("patience-without-metric", ["train.early_stopping_patience=2", "train.eval_every=1"],
     "train.early_stopping_patience: needs checkpoint.best_metric"),
    ("best-at-end-without-metric", ["checkpoint.load_best_at_end=true"], "checkpoint.load_best_at_end: needs"),
    ("label-names-count", ["data.label_names=[bad,good]"], "data.label_names: expected 5 names (data.num_labels)"),
    ("label-names-repeated", ["data.label_names=[a,b,a]", "data.num_labels=null"],
     "data.label_names: the names must be distinct"),
    ("regression-with-classes", ["data.problem_type=regression"],
     "data.num_labels: data.problem_type=regression predicts one number"),
    ("class-weights-count", ["train.class_weights=[1,2]"], "train.class_weights: expected 5 weights"),
    ("class-weights-kind", ["train.class_weights=inverse"],
     "train.class_weights: must be null, balanced or a list of positive numbers"),
    ("smoothing-multi-label", ["data.problem_type=multi_label", "train.label_smoothing=0.1"],
     "train.label_smoothing: smooths single_label's cross-entropy"),
    ("one-class", ["data.num_labels=1"], "data.num_labels: single_label needs 2 or more classes"),
    ("lora-rank-zero", ["model.lora.r=0"], "model.lora.r: must be >= 1 or null"),
    ("lora-dropout", ["model.lora.r=8", "model.lora.dropout=1"], "model.lora.dropout: must be in [0, 1)"),
    ("adapter-without-lora", ["checkpoint.export_adapter=true"], "checkpoint.export_adapter: needs model.lora.r"),
    ("bf16-base-without-lora", ["model.dtype=bf16"], "model.dtype: bf16 stores the frozen weights of a LoRA run"),
    ("bf16-base-fp32-compute", ["model.dtype=bf16", "model.lora.r=8", "train.precision=fp32"],
     "model.dtype: bf16 weights need bf16 compute, but train.precision is fp32"),
    ("unknown-base-dtype", ["model.dtype=fp16"], "model.dtype"),
    ("unknown-strategy", ["train.strategy=hsdp"], "train.strategy: must be one of ddp, fsdp, dp, got 'hsdp'"),
    ("hook-without-ddp", ["train.strategy=fsdp", "ddp.comm_hook=powersgd"],
     "ddp.comm_hook: powersgd compresses DDP's all-reduce, and train.strategy=fsdp has none"),
    ("packing-under-dp", ["train.strategy=dp", "data.packing=true"],
     "data.packing: nn.DataParallel (train.strategy=dp) splits a batch by rows"),
    ("powersgd-rank-zero", ["ddp.powersgd_rank=0"], "ddp.powersgd_rank: must be >= 1"),
    ("unknown-hook", ["ddp.comm_hook=int8"], "ddp.comm_hook"),
]
"""The mistakes that only the model or the data show (max_length beyond the model's
positions, a missing column, a missing split, labels out of range) are
tests/e2e/test_usage_errors.py's."""


@pytest.mark.parametrize("case, extra, expected", BAD_OVERRIDES, ids=[c[0] for c in BAD_OVERRIDES])
def test_bad_override(tiny_model, reviews, tmp_path, case, extra, expected):
    out = tmp_path / "run"
    assert expected in refusal(tiny_overrides(tiny_model, reviews, out, **{"train.max_steps": 2}) + extra)


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
def test_bad_config_file(tmp_path, content, expected):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(content)
    assert expected in refusal([], config_file=str(config_file))


def test_missing_config_file(tmp_path):
    assert "nope.yaml: not found" in refusal([], config_file=str(tmp_path / "nope.yaml"))


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
def test_inconsistent_launcher_environment(tiny_model, reviews, tmp_path, env, expected):
    """Never a silent world of one: a half-set environment is refused before any rendezvous."""
    out = tmp_path / "run"
    assert "environment: " + expected in refusal(tiny_overrides(tiny_model, reviews, out), environ=env)
    assert not out.exists()


GRANTED_GPUS = [{"SLURM_GPUS_ON_NODE": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": "all"}]


@pytest.mark.parametrize("granted", GRANTED_GPUS, ids=lambda env: next(iter(env)))
def test_granted_gpus_that_cuda_cannot_use_are_an_error_not_a_cpu_run(tiny_model, reviews, tmp_path, granted):
    """A GPU job on a node whose driver is too old, or in a container without --gpus, would
    train on CPU hundreds of times slower: refused before the rendezvous, naming the variable
    that shows GPUs, what torch.cuda says and the torch build (a CPU build on this machine)."""
    out = tmp_path / "run"
    message = refusal(tiny_overrides(tiny_model, reviews, out), environ=granted)
    name, value = next(iter(granted.items()))
    assert f"train.device: {name}={value} grants this job GPUs, but torch.cuda.is_available() is False: torch " \
        in message
    assert "CPU-only build (torch.version.cuda is None)" in message
    assert "set train.device=cpu dist.backend=gloo" in message
    assert not out.exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_rank_refuses_granted_gpus_before_the_rendezvous(tiny_model, reviews, tmp_path, rank):
    """Each rank of a torchrun job decides alone, before it would wait for its peers."""
    env = {**TORCHRUN_ENV, "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "9",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    message = refusal(tiny_overrides(tiny_model, reviews, tmp_path / "run"), environ=env)
    assert "train.device: CUDA_VISIBLE_DEVICES=0,1 grants this job GPUs" in message
    assert not (tmp_path / "run").exists()


def test_a_global_batch_the_world_size_cannot_split_is_refused_before_the_rendezvous(tiny_model, reviews,
                                                                                      tmp_path):
    """Rank 2 of 3: 16 samples per step can't be dealt evenly to 3 ranks."""
    env = {**TORCHRUN_ENV, "RANK": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "3",
           "MASTER_PORT": "9"}
    message = refusal(tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"train.global_batch": 16}),
                      environ=env)
    assert "train.global_batch: 16 samples per step cannot be split evenly over world size 3" in message
    assert not (tmp_path / "run").exists()


def test_dp_refuses_several_ranks(tiny_model, reviews, tmp_path):
    """Each of 2 torchrun ranks, as it starts: nn.DataParallel is one process's."""
    out = tmp_path / "run"
    message = refusal(tiny_overrides(tiny_model, reviews, out, **{"train.strategy": "dp"}), environ=TORCHRUN_ENV)
    assert "train.strategy: dp (nn.DataParallel) runs in one process" in message
    assert not out.exists()


def test_an_unknown_key_in_allow_changes_is_an_error(tiny_model, reviews, tmp_path):
    message = refusal(tiny_overrides(tiny_model, reviews, tmp_path, **{
        "checkpoint.allow_changes": "[train.learning_rate]"}))
    assert "checkpoint.allow_changes: 'train.learning_rate' is not a config key" in message



def test_predict_points_to_score():
    """`predict` became `score`: one way to apply a model, and one line saying how."""
    from trainer.cli.main import parse_args

    with pytest.raises(ConfigError, match=r"^predict: now `score`, for a file or a corpus: python -m trainer score "
                                          r"-c CONFIG score.input=FILE\|FOLDER\|GLOB score.output=FOLDER"):
        parse_args(["predict", "-c", "x.yaml", "input=a.jsonl", "output=b.jsonl"])
