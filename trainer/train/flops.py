"""MFU's two halves: the model's training FLOPs (`FlopModel`) and the device's peak FLOP/s
(`peak_flops`: a GPU's from its data sheet, a CPU's from a matmul measured after the first step)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.runtime.devices import has_native_bf16

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Dense (non-sparse) peak FLOP/s from the vendors' data sheets, by the exact name that
# torch.cuda.get_device_name() reports: matching by fragment would take an "NVIDIA L40" for
# an "L4". None: the GPU has no fast kernels in that precision (bf16 before Ampere).
_GPU_PEAKS: dict[str, tuple[float | None, float, float]] = {  # name: (bf16, fp16, fp32 without TF32)
    "NVIDIA H200": (989e12, 989e12, 67e12),
    "NVIDIA H100 80GB HBM3": (989e12, 989e12, 67e12),
    "NVIDIA H100 NVL": (835e12, 835e12, 60e12),
    "NVIDIA H100 PCIe": (756e12, 756e12, 51e12),
    **dict.fromkeys(("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe",
                     "NVIDIA A100-PCIE-40GB"), (312e12, 312e12, 19.5e12)),
    "NVIDIA L40S": (362e12, 362e12, 91.6e12),
    "NVIDIA L40": (181e12, 181e12, 90.5e12),
    "NVIDIA L4": (121e12, 121e12, 30.3e12),
    "NVIDIA A10": (125e12, 125e12, 31.2e12),
    "NVIDIA A10G": (70e12, 70e12, 31.2e12),
    **dict.fromkeys(("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), (None, 125e12, 15.7e12)),
    **dict.fromkeys(("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), (None, 112e12, 14e12)),
    "Tesla T4": (None, 65e12, 8.1e12),
}
_PRECISION_COLUMN = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device: torch.device, dtype: torch.dtype, given_tflops: float | None = None
               ) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, where the figure comes from). None: unknown,
    and MFU with it; a guessed denominator would make MFU a number nobody can compare.

    A GPU's comes from its data sheet. A CPU has no agreed peak, so its own is measured: the
    best of a 1024^3 matmul in fp32 and, where the CPU has native kernels for it, in the
    run's precision. An emulated precision (bf16 without AVX512-BF16 or AMX, fp16 without
    AMX-FP16) runs on the fp32 units, so fp32 bounds it: measuring the emulation itself gave a
    peak the model's own kernels beat (an MFU of 363%), and cost seconds at start-up.
    """
    if given_tflops is not None:
        return given_tflops * 1e12, "train.peak_tflops"
    if device.type != "cuda":
        measured = [torch.float32]
        if dtype != torch.float32 and _has_native_cpu_kernels(dtype):
            measured.append(dtype)
        names = " and ".join(_PRECISION_NAMES[d] for d in measured)
        return (max(_measured_matmul_peak(device, d) for d in measured),
                f"measured: 1024^3 matmul on {device.type}, {names}")
    name = torch.cuda.get_device_name(device)
    peaks = _GPU_PEAKS.get(name)
    peak = peaks[_PRECISION_COLUMN[dtype]] if peaks else None
    if peak is None:
        precision = str(dtype).removeprefix("torch.")
        return None, f"unknown for {name} in {precision}: set train.peak_tflops from its data sheet"
    return peak, f"data sheet for {name}"


def _has_native_cpu_kernels(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return has_native_bf16(torch.device("cpu"))
    return dtype == torch.float16 and torch.cpu._is_amx_fp16_supported()


def _measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    # The best of several: a CPU shared with other work slows some repetitions, and a peak
    # measured low would be beaten by the model later (MFU then reports unknown). ~0.3 s,
    # once, after the first step.
    # A generator of its own: this runs mid-run, after the first step, and a draw from torch's
    # global RNG there would shift every dropout mask after it (a resume, which measures
    # again after its own first step, would no longer be bitwise).
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms up the kernels
        _sync(device)
        started = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class FlopModel:
    """Training FLOPs of a transformer encoder, counted on real (unpadded) tokens.

    Per token: 6 x the parameters of the linear layers that train (forward 2, backward 4:
    the input's gradient and the weight's), 4 x those of frozen ones (LoRA's base: backward
    still passes the input's gradient down to the adapters below, but computes no weight
    gradient). Per sequence of length s, attention scores and the weighted sum add 12 x
    layers x hidden x s^2. Embedding lookups do no matmul work, so 6 x all parameters would
    overcount by ~2x.
    """

    linear_params: int
    """Weights of the linear layers that train."""
    layers: int
    hidden: int
    frozen_linear_params: int = 0
    """Weights of the frozen linear layers the forward runs."""

    @classmethod
    def of(cls, model: PreTrainedModel) -> FlopModel:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers (transposed weights)

        # Not peft's `original_module`: the head's frozen copy, which the forward never runs.
        weights = [m.weight for name, m in model.named_modules()
                   if isinstance(m, (nn.Linear, Conv1D)) and ".original_module" not in name]
        config = model.config
        return cls(sum(w.numel() for w in weights if w.requires_grad), config.num_hidden_layers, config.hidden_size,
                   sum(w.numel() for w in weights if not w.requires_grad))

    def train_flops(self, tokens: int, sum_squared_lengths: int) -> float:
        return ((6.0 * self.linear_params + 4.0 * self.frozen_linear_params) * tokens
                + 12.0 * self.layers * self.hidden * sum_squared_lengths)
