"""Speed accounting: the device's peak FLOP/s (for MFU) and cheap per-phase step timers."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

# Dense (non-sparse) peak FLOP/s from the vendors' data sheets, by precision.
_GPU_PEAKS = {  # name fragment: (bf16, fp32 / tf32 off)
    "H200": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (70e12, 31.2e12),
    "L4": (121e12, 30.3e12),
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    bf16 = dtype == torch.bfloat16
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (bf16_peak, fp32_peak) in _GPU_PEAKS.items():
            if fragment in name:
                return (bf16_peak if bf16 else fp32_peak), f"data sheet for {name}"
    return _measured_matmul_peak(device, dtype), f"measured: {1024}^3 matmul on {device.type}"


def _measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
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


class PhaseTimer:
    """Wall time per training phase, summed over a logging window.

    No device sync is added for it: on a GPU the host runs ahead of the kernels it
    launched, and their time shows up in the phase where the host next waits.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._phase: str | None = None
        self._started = 0.0

    def start(self, phase: str) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] += now - self._started
        self._phase, self._started = phase, now

    def stop(self) -> None:
        self.start(None)  # type: ignore[arg-type]
        self._phase = None

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken
