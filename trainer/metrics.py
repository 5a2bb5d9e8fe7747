"""Metrics: what the logs, metrics.jsonl and summary.json say about speed and quality.

- `Meter`: a logging window's loss, tokens, steps and time (eval and checkpoints kept out),
  closed by one all-reduce into global figures and one log line.
- `PhaseTimer` and `CommClock`: where a step's time goes (data, forward, backward, exposed
  communication, optimizer).
- `FlopModel` and `peak_flops`: model FLOPs of the real tokens over the device's peak (MFU).
- `StartupClock`: launch to first optimizer step, phase by phase.
- `confusion_metrics`, `per_class_metrics`: accuracy, macro F1 and each class's precision,
  recall, F1 and support from a confusion matrix.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from trainer import distributed
from trainer.distributed import DistEnv

# Dense (non-sparse) peak FLOP/s from the vendors' data sheets, by the exact name that
# torch.cuda.get_device_name() reports: matching by fragment would take an "NVIDIA L40" for
# an "L4". None: the GPU has no fast kernels in that precision (bf16 before Ampere).
_GPU_PEAKS: dict[str, tuple[float | None, float, float]] = {  # name: (bf16, fp16, fp32 without TF32)
    "NVIDIA H200": (989e12, 989e12, 67e12),
    "NVIDIA H100 80GB HBM3": (989e12, 989e12, 67e12),
    "NVIDIA H100 NVL": (835e12, 835e12, 60e12),
    "NVIDIA H100 PCIe": (756e12, 756e12, 51e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 312e12, 19.5e12),
    "NVIDIA A100-SXM4-40GB": (312e12, 312e12, 19.5e12),
    "NVIDIA A100 80GB PCIe": (312e12, 312e12, 19.5e12),
    "NVIDIA A100-PCIE-40GB": (312e12, 312e12, 19.5e12),
    "NVIDIA L40S": (362e12, 362e12, 91.6e12),
    "NVIDIA L40": (181e12, 181e12, 90.5e12),
    "NVIDIA L4": (121e12, 121e12, 30.3e12),
    "NVIDIA A10": (125e12, 125e12, 31.2e12),
    "NVIDIA A10G": (70e12, 70e12, 31.2e12),
    "Tesla V100-SXM2-16GB": (None, 125e12, 15.7e12),
    "Tesla V100-SXM2-32GB": (None, 125e12, 15.7e12),
    "Tesla V100-PCIE-16GB": (None, 112e12, 14e12),
    "Tesla V100-PCIE-32GB": (None, 112e12, 14e12),
    "Tesla T4": (None, 65e12, 8.1e12),
}
_PRECISION_COLUMN = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def peak_flops(device: torch.device, dtype: torch.dtype, given_tflops: float | None = None
               ) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, where the figure comes from). None: unknown,
    and MFU with it; a guessed denominator would make MFU a number nobody can compare.

    A GPU's comes from its data sheet; a CPU's from a 1024^3 matmul measured at start-up
    (CPUs have no agreed peak; fp16, which has no fast CPU kernels, is measured in fp32).
    """
    if given_tflops is not None:
        return given_tflops * 1e12, "train.peak_tflops"
    if device.type != "cuda":
        measured = torch.float32 if dtype == torch.float16 else dtype
        return _measured_matmul_peak(device, measured), f"measured: {1024}^3 matmul on {device.type}"
    name = torch.cuda.get_device_name(device)
    peaks = _GPU_PEAKS.get(name)
    peak = peaks[_PRECISION_COLUMN[dtype]] if peaks else None
    if peak is None:
        precision = str(dtype).removeprefix("torch.")
        return None, f"unknown for {name} in {precision}: set train.peak_tflops from its data sheet"
    return peak, f"data sheet for {name}"


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


@dataclass(frozen=True)
class FlopModel:
    """Training FLOPs of a transformer encoder, counted on real (unpadded) tokens.

    Per token: 6 x the parameters of the linear layers (forward 2, backward 4). Per
    sequence of length s, attention scores and the weighted sum add 12 x layers x hidden x s^2.
    Embedding lookups do no matmul work, so 6 x all parameters would overcount by ~2x.
    """

    linear_params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model: nn.Module) -> "FlopModel":
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers (transposed weights)

        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Conv1D)))
        config = model.config
        return cls(linear, config.num_hidden_layers, config.hidden_size)

    def train_flops(self, tokens: int, sum_squared_lengths: int) -> float:
        return 6.0 * self.linear_params * tokens + 12.0 * self.layers * self.hidden * sum_squared_lengths


class PhaseTimer:
    """Wall time per training phase, summed over a logging window.

    No device sync is added for it: on a GPU the host runs ahead of the kernels it
    launched, and their time shows up in the phase where the host next waits.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._phase: str | None = None
        self._started = 0.0

    def start(self, phase: str | None, at: float | None = None) -> None:
        """End the current phase and start `phase` (None: no phase), now or at an earlier `at`."""
        now = time.perf_counter() if at is None else at
        if self._phase is not None:
            self.seconds[self._phase] += now - self._started
        self._phase, self._started = phase, now

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


@dataclass
class _Window:
    """What one logging window has counted so far."""

    loss_sum: torch.Tensor
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    sum_sq_len: int = 0
    paused_s: float = 0.0
    grad_norm: torch.Tensor | None = None


class Meter:
    """Throughput and loss of the run, window by window, and the line that reports them.

    The step reports its micro-batches' tokens and losses and its end; `with meter.paused():`
    keeps eval and checkpoint time out of every rate; `take_window()` closes a window with one
    all-reduce of its totals, the only host sync per window, and returns global figures.
    """

    def __init__(self, dist_env: DistEnv, device: torch.device, global_batch: int, flop_model: FlopModel,
                 peak: float | None, max_steps: int):
        self.dist_env, self.device, self.global_batch = dist_env, device, global_batch
        self.flop_model, self.peak, self.max_steps = flop_model, peak, max_steps
        self.timer = PhaseTimer()
        self._window = self._new_window()
        self._run_started = time.perf_counter()
        self._paused_s = 0.0
        self.trained_samples = 0
        self._progress = None

    def begin(self, start_step: int) -> None:
        """The run's clock starts (at the step after `start_step`, when resuming)."""
        self._window = self._new_window()
        self._run_started = time.perf_counter()
        self._progress = _progress_bar(self.dist_env, self.max_steps, start_step)

    def _new_window(self) -> _Window:
        return _Window(loss_sum=torch.zeros((), device=self.device))

    # --- what the step reports ------------------------------------------------------------

    def phase(self, name: str | None, at: float | None = None) -> None:
        """The step enters phase `name` (None: the step is over), now or at an earlier `at`."""
        self.timer.start(name, at)

    def micro_batch(self, attention_mask: torch.Tensor) -> None:
        """Count a micro-batch's real tokens (before it moves to the device: no sync)."""
        lengths = attention_mask.sum(1)
        self._window.tokens += int(lengths.sum())
        self._window.sum_sq_len += int(lengths.square().sum())

    def loss(self, loss: torch.Tensor) -> None:
        self._window.loss_sum += loss.detach()

    def step_done(self, grad_norm: torch.Tensor | None) -> None:
        self.timer.start(None)
        self._window.steps += 1
        self._window.grad_norm = grad_norm
        self.trained_samples += self.global_batch
        if self._progress is not None:
            self._progress.update(1)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the body (eval, checkpoints) counts in no rate."""
        started = time.perf_counter()
        try:
            yield
        finally:
            paused = time.perf_counter() - started
            self._window.paused_s += paused
            self._paused_s += paused

    # --- what the loop reads ------------------------------------------------------------

    def take_window(self, epoch: int, lr: float) -> dict[str, float]:
        """Global metrics of the window since the last call, which starts a new one."""
        window, self._window = self._window, self._new_window()
        seconds = time.perf_counter() - window.started - window.paused_s
        totals = torch.tensor([window.loss_sum.item(), window.tokens, window.sum_sq_len],
                              dtype=torch.float64, device=self.device)
        loss_sum, tokens, sum_sq_len = distributed.all_reduce_sum(self.dist_env, totals).tolist()
        steps, world = window.steps, self.dist_env.world_size
        metrics = {
            "loss": loss_sum / (steps * world),  # mean over ranks of each step's mean loss
            "lr": lr,
            "epoch": epoch,
            "samples_per_s": steps * self.global_batch / seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": self.flop_model.train_flops(tokens, sum_sq_len) / seconds / (self.peak * world)
                   if self.peak else None,
            **{f"time/{phase}_s": total / steps for phase, total in self.timer.take().items()},
        }
        if window.grad_norm is not None:
            metrics["grad_norm"] = window.grad_norm.item()
        if self.device.type == "cuda":  # how full the GPU is: the batch size's headroom
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def log_line(self, step: int, metrics: dict[str, float]) -> str:
        step_ms = ", ".join(f"{k.removeprefix('time/').removesuffix('_s')} {1000 * v:.0f}"
                            for k, v in metrics.items() if k.startswith("time/"))
        return (f"step {step}/{self.max_steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.3g} | "
                f"{metrics['samples_per_s']:.1f} samples/s, {metrics['tokens_per_s']:.0f} tokens/s, "
                f"MFU {_percent(metrics['mfu'])} | ms/step: {step_ms}")

    def run_totals(self) -> dict[str, float | None]:
        """The whole run's training time and rate, pauses excluded."""
        if self._progress is not None:
            self._progress.close()
        seconds = time.perf_counter() - self._run_started - self._paused_s
        rate = self.trained_samples / seconds if self.trained_samples else None
        return {"samples_per_s": rate, "train_seconds": seconds}


def _percent(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{100 * fraction:.1f}%"


def _progress_bar(dist_env: DistEnv, max_steps: int, start_step: int):
    """A progress bar on rank 0, on a terminal only: in a batch job's log file it would be
    one endless line; the per-log-step lines carry the progress there."""
    from tqdm import tqdm

    return tqdm(total=max_steps, initial=start_step, desc="train", unit="step",
                disable=not (dist_env.is_rank_zero and sys.stderr.isatty()), dynamic_ncols=True)


def confusion_metrics(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro F1 from a [true, predicted] count matrix.

    Macro F1 averages over the classes present in the labels or the predictions, as
    scikit-learn's f1_score(average="macro") does.
    """
    confusion = confusion.double()
    true_pos = confusion.diag()
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    f1 = 2 * true_pos / (support + predicted).clamp(min=1)
    return {
        "accuracy": (true_pos.sum() / confusion.sum().clamp(min=1)).item(),
        "f1_macro": f1[present].mean().item(),
    }


def per_class_metrics(confusion: torch.Tensor, names: list[str]) -> list[dict]:
    """Precision, recall, F1 and support of each class, as scikit-learn's
    classification_report(zero_division=0) gives them: 0 where a ratio is undefined."""
    confusion = confusion.double()
    true_pos = confusion.diag()
    support, predicted = confusion.sum(1), confusion.sum(0)
    precision = torch.where(predicted > 0, true_pos / predicted.clamp(min=1), 0.0)
    recall = torch.where(support > 0, true_pos / support.clamp(min=1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    return [
        {"label": i, "name": name, "precision": precision[i].item(), "recall": recall[i].item(),
         "f1": f1[i].item(), "support": int(support[i])}
        for i, name in enumerate(names)
    ]


class StartupClock:
    """Launch to first optimizer step, phase by phase: where a job's first seconds go.

    Each mark names the phase that ends there. The launch is the launcher's start when
    under torchrun (its agent's own start-up is the "launcher" phase), else this process's.
    """

    def __init__(self) -> None:
        started = _process_start(os.getpid())
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is the parent
            self.marks = [("launch", _process_start(os.getppid())), ("launcher", started)]
        else:
            self.marks = [("launch", started)]

    def mark(self, phase: str) -> float:
        """End `phase` now; returns now as Unix time."""
        now = time.time()
        self.marks.append((phase, now))
        return now

    def phases(self) -> dict[str, float]:
        """Seconds per phase; phases whose start is unknown are left out."""
        return {
            phase: end - start
            for (_, start), (phase, end) in zip(self.marks, self.marks[1:])
            if start is not None and end is not None
        }


def _process_start(pid: int) -> float | None:
    """A process's start as Unix time, to the kernel's 10 ms tick, or None off Linux.

    Not psutil's create_time(): it adds the start tick to /proc/stat's boot time, which is
    whole seconds, so a phase measured from it is off by up to a second. The age of the
    process on the boot clock, subtracted from now, has no such rounding.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
