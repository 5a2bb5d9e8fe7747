"""Device decisions and the GPU-side mechanisms that a CPU can still prove, in process.

What needs a real GPU is in tests/e2e/test_cuda.py (skipped here); these run everywhere.
Deterministic kernels, which take a training run: tests/e2e/test_deterministic_kernels.py.
"""

from __future__ import annotations

import itertools
import platform
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainer.checkpoint.writer import host_copy
from trainer.errors import LaunchError
from trainer.runtime.devices import granted_gpus, has_native_bf16, pick_device, resolve_precision
from trainer.runtime.environment import DistEnv
from trainer.strategies.base import LogitsUnderAutocast
from trainer.tasks import registry as tasks
from trainer.tasks.space import Labels
from trainer.train.flops import peak_flops

TWO_LOCAL_RANKS = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                          master_port=29500)


@pytest.fixture
def one_gpu(monkeypatch):
    """torch believes one GPU is visible: the decision, not the device, is under test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_gloo_ranks_may_share_a_gpu(one_gpu):
    assert pick_device(TWO_LOCAL_RANKS, "gloo") == (torch.device("cuda", 0), "gloo")


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_nccl_refuses_more_ranks_than_gpus(one_gpu, backend):
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=1 but only 1 GPU\(s\) are visible.*dist.backend=gloo"):
        pick_device(TWO_LOCAL_RANKS, backend)


def test_host_copy_is_a_snapshot_that_keeps_tied_tensors_tied():
    weight = torch.randn(4, 3)
    state = {"model": {"embed": weight, "tied_head": weight, "bias": torch.zeros(3)},
             "optimizer": {"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1}]}}
    before = weight.clone()
    copied = host_copy(state)
    weight.add_(1.0)  # training goes on after the snapshot
    assert torch.equal(copied["model"]["embed"], before)
    assert copied["model"]["embed"].data_ptr() == copied["model"]["tied_head"].data_ptr()
    assert copied["model"]["embed"].data_ptr() != weight.data_ptr()
    assert copied["optimizer"]["param_groups"] == [{"lr": 0.1}] and copied["optimizer"]["state"][0]["step"] == 5


@pytest.mark.parametrize("environ", [{}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                                     {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, {"NVIDIA_VISIBLE_DEVICES": "void"},
                                     {"NVIDIA_VISIBLE_DEVICES": "none"}, {"SLURM_GPUS_ON_NODE": "0"}])
def test_no_gpus_granted_means_the_cpu(environ):
    assert granted_gpus(environ) is None
    assert pick_device(DistEnv(), "auto", "auto", environ) == (torch.device("cpu"), "gloo")


def test_cpu_on_purpose_even_where_cuda_works(one_gpu):
    assert pick_device(TWO_LOCAL_RANKS, "auto", "cpu", {"CUDA_VISIBLE_DEVICES": "0,1"}) == (torch.device("cpu"),
                                                                                           "gloo")


# --- precision: what `auto` picks, by device ----------------------------------------------------


def a_gpu(monkeypatch, capability: tuple[int, int]) -> torch.device:
    """torch believes this rank's GPU has `capability`; is_bf16_supported() answers as torch
    does by default, with emulation: True on every CUDA GPU, V100 and T4 included."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
                        or capability >= (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
                         ids=["V100", "T4", "A100", "H100"])
def test_auto_precision_on_gpus_is_native_bf16_or_fp16(monkeypatch, capability, expected):
    assert resolve_precision("auto", a_gpu(monkeypatch, capability)) == expected


def a_cpu(monkeypatch, native_bf16: bool) -> torch.device:
    """torch believes this CPU has (or lacks) bf16 instructions, whatever its architecture."""
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: native_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if native_bf16 else "AVX2")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    return torch.device("cpu")


@pytest.mark.parametrize("native", [True, False], ids=["avx512-bf16", "avx2"])
def test_auto_precision_on_cpus_is_native_bf16_or_fp32(monkeypatch, native):
    assert resolve_precision("auto", a_cpu(monkeypatch, native)) == (torch.bfloat16 if native else torch.float32)


def cpu_flags() -> set[str]:
    """The CPU's features as the kernel lists them: a source independent of torch's."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith(("flags", "Features")))
    return set(flags.split(":", 1)[1].split())


def test_native_cpu_bf16_follows_the_cpus_own_features():
    """On whatever CPU runs this: AVX512-BF16 or AMX-BF16 on x86, the BF16 extension on Arm.
    Not the AVX-512 foundation, which mkldnn's own check takes for bf16."""
    wanted = {"avx512_bf16", "amx_bf16"} if platform.machine() == "x86_64" else {"bf16"}
    assert has_native_bf16(torch.device("cpu")) == bool(wanted & cpu_flags())


@pytest.mark.parametrize("arch, missing", [("x86_64", "no AVX512-BF16, no AMX"),
                                           ("aarch64", "aarch64: no BF16 extension")], ids=["x86", "arm"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
def test_explicit_bf16_on_a_cpu_without_it_warns_naming_what_is_missing(monkeypatch, caplog, arch, missing, native):
    """Each architecture's own missing instructions, whichever CPU runs the test."""
    monkeypatch.setattr(platform, "machine", lambda: arch)
    assert resolve_precision("bf16", a_cpu(monkeypatch, native)) == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = (f"train.precision: bf16 is emulated on this CPU ({missing}), about 15x slower than fp32; "
            "fp32 (or auto) is fast here")
    assert warnings == ([] if native else [said])


@pytest.mark.parametrize("precision, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                 ("fp16", torch.float16)])
def test_explicit_precision_is_kept(monkeypatch, precision, expected):
    assert resolve_precision(precision, a_gpu(monkeypatch, (7, 0))) == expected
    assert resolve_precision(precision, torch.device("cpu")) == expected


# --- nn.DataParallel: autocast per replica thread, and the loss over the whole batch ------------


@pytest.fixture
def cpu_replica_threads(monkeypatch):
    """torch's own nn.parallel.parallel_apply, which DataParallel runs each replica's forward
    with, made to accept CPU modules: it still gives each replica a thread of its own and
    re-enters autocast there the way it does on GPUs. What it calls on the accelerator
    (streams, device guards) becomes a no-op."""
    import sys
    from contextlib import nullcontext

    import torch.nn.parallel.parallel_apply

    module = sys.modules["torch.nn.parallel.parallel_apply"]
    monkeypatch.setattr(module, "_get_device_index", lambda device, optional=False: -1)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda *a, **k: nullcontext())
    return lambda replicas, inputs: module.parallel_apply(replicas, [()] * len(inputs), inputs, [0] * len(inputs))


def replica_batches(tiny_model, sizes: list[int]) -> tuple[dict, list[dict]]:
    """A batch of sum(sizes) reviews, and its split into one chunk per replica, as
    DataParallel's scatter splits it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = [f"The food was {'good ' * i}and the staff was rude." for i in range(sum(sizes))]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    batch["labels"] = torch.arange(sum(sizes)) % 5
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return batch, [{k: v[a:b] for k, v in batch.items()} for a, b in itertools.pairwise(bounds)]


def test_each_replica_thread_computes_in_the_configured_dtype(tiny_model, cpu_replica_threads):
    """DataParallel re-enters autocast in each replica's thread without a dtype, so the
    device's default replaces the configured one (on CUDA: fp16, with no loss scaler, for a
    bf16 run; on CPU autocast is off there altogether). The configured dtype here is the one
    the CPU's default is not."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model)
    replica = LogitsUnderAutocast(model, "cpu", torch.float16)
    _, chunks = replica_batches(tiny_model, [3, 2])
    inputs = [{k: v for k, v in chunk.items() if k != "labels"} for chunk in chunks]
    with torch.autocast("cpu", dtype=torch.float16):  # where the training step used to enter it
        logits = cpu_replica_threads([replica, replica], inputs)
        bare = cpu_replica_threads([model, model], inputs)  # the bare model, as DataParallel used to run it
    assert [out.dtype for out in logits] == [torch.float16, torch.float16]
    assert [out.logits.dtype for out in bare] == [torch.float32, torch.float32]  # the configured dtype was lost


def test_the_loss_weighs_every_sample_alike_when_replicas_get_unequal_shares(tiny_model, cpu_replica_threads):
    """5 samples on 2 replicas (3 and 2): the loss over the gathered logits is the mean over
    all 5, which the mean of the replicas' own mean losses is not."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model)
    replica = LogitsUnderAutocast(model, "cpu", torch.float32)
    batch, chunks = replica_batches(tiny_model, [3, 2])
    inputs = [{k: v for k, v in chunk.items() if k != "labels"} for chunk in chunks]
    gathered = torch.cat(cpu_replica_threads([replica, replica], inputs))  # DataParallel's gather
    whole = torch.nn.functional.cross_entropy(model(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                              batch["labels"])
    per_replica = torch.stack([model(**chunk).loss for chunk in chunks]).mean()
    task = tasks.of(Labels("single_label", tuple("abcde"), "test", "ids"), OmegaConf.create({"threshold": 0.5}))
    assert torch.allclose(task.sample_losses(gathered, batch["labels"]).mean(), whole, atol=1e-6)
    assert not torch.allclose(per_replica, whole, atol=1e-4)  # the old weighting, for contrast


# --- MFU's denominator --------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA L4", torch.bfloat16, 121e12), ("NVIDIA L40", torch.bfloat16, 181e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12), ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12), ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
])
def test_peak_flops_come_from_the_data_sheet_of_exactly_this_gpu(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == (expected, f"data sheet for {name}")


@pytest.mark.parametrize("name, dtype", [("NVIDIA L4X", torch.bfloat16), ("NVIDIA RTX 6000 Ada Generation",
                                                                        torch.bfloat16),
                                         ("Tesla V100-SXM2-16GB", torch.bfloat16)])
def test_an_unknown_peak_is_unknown_not_a_measured_guess(monkeypatch, name, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = peak_flops(torch.device("cuda", 0), dtype)
    assert peak is None and "set train.peak_tflops" in source
    assert peak_flops(torch.device("cuda", 0), dtype, given_tflops=200.0) == (200e12, "train.peak_tflops")


def test_mfu_is_logged_as_unknown_without_a_peak():
    """The whole window of a run on a GPU whose peak is unknown: MFU null, not a number."""
    from trainer.train.flops import FlopModel
    from trainer.train.metrics import Meter

    meter = Meter(DistEnv(), torch.device("cpu"), 16, FlopModel(1000, 2, 32), max_steps=1)
    meter.begin(0)
    meter.micro_batch(torch.full((16,), 8))
    meter.step_done(torch.tensor(1.0), None)
    window = meter.take_window(0, 1e-3)
    assert window["mfu"] is None
    assert "MFU unknown" in meter.log_line(1, window)
