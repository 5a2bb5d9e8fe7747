"""Speed accounting: the device's peak FLOP/s (for MFU) and cheap per-phase step timers."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

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

    def start(self, phase: str, at: float | None = None) -> None:
        """End the current phase and start `phase`, now or at an earlier `at`."""
        now = time.perf_counter() if at is None else at
        if self._phase is not None:
            self.seconds[self._phase] += now - self._started
        self._phase, self._started = phase, now

    def stop(self) -> None:
        self.start(None)  # type: ignore[arg-type]
        self._phase = None

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


class CommClock:
    """A DDP comm hook: the default all-reduce, noting when each bucket became ready.

    The last bucket is ready when backward's compute is done, so whatever backward() still
    takes after that is communication that did not overlap with compute (exposed). Exact
    on CPU, where backward() blocks until the all-reduce ends. On GPU the host runs ahead
    of the kernels, and the wait shows up in the next phase that synchronizes.
    """

    def __init__(self, allreduce_hook) -> None:
        self.allreduce_hook = allreduce_hook
        self.last_ready: float | None = None

    @classmethod
    def attach(cls, ddp: torch.nn.parallel.DistributedDataParallel) -> "CommClock":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        clock = cls(allreduce_hook)
        ddp.register_comm_hook(None, clock._hook)
        return clock

    def _hook(self, process_group, bucket):
        self.last_ready = time.perf_counter()
        return self.allreduce_hook(process_group, bucket)

    def take(self) -> float | None:
        """When the last bucket of the latest backward became ready (None without one)."""
        taken, self.last_ready = self.last_ready, None
        return taken


class StartupClock:
    """Launch to first optimizer step, phase by phase: where a job's first seconds go.

    Each mark names the phase that ends there. The launch is the launcher's start when
    under torchrun (its agent's own start-up is the "launcher" phase), else this process's.
    """

    def __init__(self) -> None:
        started = _process_start(os.getpid())
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self.marks = [("launch", _process_start(os.getppid())), ("launcher", started)]
        else:
            self.marks = [("launch", started)]

    def mark(self, phase: str) -> float:
        """End `phase` now; returns now as Unix time."""
        now = time.time()
        self.marks.append((phase, now))
        return now

    def phases(self) -> dict[str, float]:
        """Seconds per phase; phases whose start is unknown (no /proc) are left out."""
        return {
            phase: end - start
            for (_, start), (phase, end) in zip(self.marks, self.marks[1:])
            if start is not None and end is not None
        }


def _process_start(pid: int) -> float | None:
    """A process's start as Unix time, from /proc (10 ms resolution), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
