"""The speed figures in the trainer's own logs add up: step-time phases to the measured step
time, tokens/s to the real tokens of the batches, start-up phases to launch-to-first-step.

Speed itself is measured by `python -m benchmarks`, not here: these check the accounting.
"""

import json
import subprocess

import numpy as np
import pytest
import torch
from support.outputs import read_metrics, read_summary
from support.processes import kill_tree
from support.runs import BASE_ENV, REPO, launch, tiny_overrides, trainer_command
from transformers import AutoTokenizer

from trainer.config.schema import Config
from trainer.data.samplers import GlobalBatchSampler
from trainer.runtime.environment import DistEnv
from trainer.runtime.startup import _process_start

STEPS, LOG_EVERY, PER_RANK = 8, 4, 8
PHASES = ["data", "forward", "backward", "comm", "optimizer"]


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, reviews, tmp_path_factory):
    """The run, and torchrun's process start as the trainer reads it (/proc, the boot clock),
    read while torchrun runs: the launch that launch-to-first-step counts from."""
    out = tmp_path_factory.mktemp("perf")
    overrides = tiny_overrides(tiny_model, reviews, out, **{
        "train.batch_size": PER_RANK, "train.max_steps": STEPS, "train.log_every": LOG_EVERY, "checkpoint.every": 4,
    })
    proc = subprocess.Popen(trainer_command(overrides, nproc=2), cwd=REPO, env=BASE_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        launched = _process_start(proc.pid)
        output, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output[-6000:]
    return launched, output, read_metrics(out), read_summary(out)


def test_step_phases_are_measured_within_the_step(two_rank_run):
    """Every phase is measured, takes time, and together they never exceed the step. That the
    phases are the whole step, the loop's bookkeeping aside, is a claim about the code, not
    this machine's load: tests/unit/test_meter.py holds it with a fake clock, and
    tests/unit/test_build.py that every part of the training step runs inside a phase."""
    _, output, records, _ = two_rank_run
    windows = [r for r in records if "samples_per_s" in r]
    assert [w["step"] for w in windows] == [4, 8]
    for window in windows:
        assert sorted(k for k in window if k.startswith("time/")) == sorted(f"time/{p}_s" for p in PHASES)
        step_s = 2 * PER_RANK / window["samples_per_s"]
        assert all(window[f"time/{p}_s"] > 0 for p in PHASES), window
        assert sum(window[f"time/{p}_s"] for p in PHASES) <= step_s * (1 + 1e-9), window
        assert 0 < window["mfu"] < 1
    assert "ms/step: data" in output and "comm" in output
    assert "(measured: 1024^3 matmul on cpu, fp32" in output  # where the MFU's peak comes from


def test_tokens_per_s_counts_real_tokens(two_rank_run, tiny_model, reviews):
    """tokens/s x window time == the unpadded tokens of exactly the samples trained on."""
    _, _, records, _ = two_rank_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [json.loads(line) for line in (reviews / "train.jsonl").read_text().splitlines()]
    lengths = np.array([len(ids) for ids in tokenizer([r["text"] for r in rows], truncation=True,
                                                       max_length=64)["input_ids"]])
    # The global order does not depend on the world size: rebuild it in this process.
    labels = np.zeros(len(lengths), dtype=np.int64)  # the order doesn't read them
    order = GlobalBatchSampler(lengths, labels, 2 * PER_RANK, DistEnv(), Config().seed,
                               group_by_length=True).global_order(0)
    windows = [r for r in records if "samples_per_s" in r]
    for i, window in enumerate(windows):
        samples = order[i * LOG_EVERY * 2 * PER_RANK: (i + 1) * LOG_EVERY * 2 * PER_RANK]
        seconds = LOG_EVERY * 2 * PER_RANK / window["samples_per_s"]
        assert window["tokens_per_s"] * seconds == pytest.approx(int(lengths[samples].sum()), rel=1e-6)


def test_startup_phases_add_up_to_launch_to_first_step(two_rank_run):
    launched, output, records, summary = two_rank_run
    phases = summary["startup_s"]
    assert list(phases) == ["launcher", "imports", "rendezvous", "data", "model", "tokenize", "setup",
                            "first_step"]
    assert all(seconds >= 0 for seconds in phases.values())
    # The launch is torchrun's process start: the phases add up to the time from it to the first
    # step's end (both from /proc's 10 ms ticks on the boot clock, however loaded the machine).
    assert sum(phases.values()) == pytest.approx(summary["first_step_end_unix"] - launched, abs=0.02)
    assert "launch to first step" in output
    saves = [r for r in records if "checkpoint/save_s" in r]
    assert [r["step"] for r in saves] == [4, 8] and all(r["checkpoint/save_s"] > 0 for r in saves)


# torch's and oneDNN's kernels held to AVX2: bf16 is emulated as on a CPU without AVX512-BF16 or
# AMX, whatever CPU runs the test.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def mfu_run(reviews, out, precision: str, env: dict, *extra: str) -> tuple[list, str]:
    """The demo's MiniLM for 3 logged steps: each window's MFU, and the run's output."""
    overrides = [f"data.path={reviews}", f"output_dir={out}", f"train.precision={precision}",
                 "train.max_steps=3", "train.log_every=1", "train.batch_size=4", "data.max_length=32",
                 "checkpoint.every=0", "data.max_eval_samples=16", "data.num_workers=0", "wandb.mode=disabled", *extra]
    result = launch(trainer_command(overrides, nproc=None, config="configs/demo.yaml"), env=env)
    assert result.returncode == 0, result.output[-6000:]
    mfus = [r["mfu"] for r in read_metrics(out) if "samples_per_s" in r]
    assert len(mfus) == 3, mfus
    return mfus, result.output


@pytest.mark.parametrize("precision, env", [("fp32", {}), ("bf16", {}), ("bf16", AVX2_ONLY)],
                         ids=["fp32", "bf16", "bf16-emulated"])
def test_the_cpu_peak_is_timed_on_the_units_the_model_runs_on(reviews, tmp_path, precision, env):
    """The peak is the best 1024^3 matmul in fp32 and, where the CPU has native kernels for it,
    in the run's precision: never the emulation (timed, it gave an MFU of 363%). Against it MFU
    is a fraction, or unknown with the warning: whether a busy machine timed the peak low is
    not the run's to decide, so a value is not required here (the next test requires one)."""
    from trainer.runtime.devices import has_native_bf16

    mfus, output = mfu_run(reviews, tmp_path, precision, env)
    timed = "fp32 and bf16" if precision == "bf16" and not env and has_native_bf16(torch.device("cpu")) else "fp32"
    assert "MFU's peak: " in output and f"(measured: 1024^3 matmul on cpu, {timed})" in output, output[-3000:]
    assert all(mfu is None or 0 < mfu <= 1 for mfu in mfus), mfus
    assert None not in mfus or "MFU unknown from here on" in output, mfus
    if env:
        assert "bf16 is emulated on this CPU (no AVX512-BF16, no AMX)" in output


def test_mfu_is_the_models_flops_over_a_given_peak_in_every_window(reviews, tmp_path):
    """train.peak_tflops, far above any CPU's (1 PFLOP/s): every window reports an MFU, from
    the run's own FLOPs and times, a small positive fraction."""
    mfus, output = mfu_run(reviews, tmp_path, "fp32", {}, "train.peak_tflops=1000")
    assert all(mfu is not None and 0 < mfu < 0.01 for mfu in mfus), mfus
    assert "MFU's peak: 1e+15 FLOP/s (train.peak_tflops)" in output, output[-3000:]
