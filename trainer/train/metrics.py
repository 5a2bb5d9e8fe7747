"""The run's throughput and loss bookkeeping: what the logs, metrics.jsonl and summary.json
say about speed and loss.

- `Meter`: a logging window's loss, tokens, steps and time (eval and checkpoints kept out),
  closed by one all-reduce into global figures and one log line.
- `PhaseTimer`: where a step's time goes (data, forward, backward, exposed communication,
  optimizer).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.train.flops import FlopModel
from trainer.train.step import StepObserver

log = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Seconds on a monotonic clock: time.perf_counter, or a test's fake."""


class PhaseTimer:
    """Wall time per training phase, summed over a logging window.

    No device sync is added for it: on a GPU the host runs ahead of the kernels it
    launched, and their time shows up in the phase where the host next waits.
    """

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._phase: str | None = None
        self._started = 0.0

    def start(self, phase: str | None, at: float | None = None) -> None:
        """End the current phase and start `phase` (None: no phase), now or at an earlier `at`."""
        now = self.clock() if at is None else at
        if self._phase is not None:
            self.seconds[self._phase] += now - self._started
        self._phase, self._started = phase, now

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


@dataclass
class _Window:
    """What one logging window has counted so far."""

    loss_sum: torch.Tensor
    started: float
    steps: int = 0
    tokens: int = 0
    sum_sq_len: int = 0
    paused_s: float = 0.0
    grad_norm: torch.Tensor | None = None
    skipped: int = 0
    """Step tries skipped for a loss or gradient that was not finite (trainer/faults/numerics.py)."""


class Meter(StepObserver):
    """Throughput and loss of the run, window by window, and the line that reports them.

    The step reports its micro-batches' tokens and losses and its end; `with meter.paused():`
    keeps eval and checkpoint time out of every rate; `take_window()` closes a window with one
    all-reduce of its totals, the only host sync per window, and returns global figures.
    Every time is on `clock`'s scale, a phase's `at` too (DDP's BucketClock's: time.perf_counter's).
    """

    def __init__(self, dist_env: DistEnv, device: torch.device, global_batch: int, flop_model: FlopModel,
                 max_steps: int, peak: float | None = None, clock: Clock = time.perf_counter):
        self.dist_env, self.device, self.global_batch = dist_env, device, global_batch
        self.flop_model, self.max_steps = flop_model, max_steps
        self.peak = peak
        """One device's peak FLOP/s, MFU's denominator: the Trainer sets it after the first step, on rank 0,
        which logs MFU (None on the others)."""
        self.clock = clock
        self.timer = PhaseTimer(clock)
        self._window = self._new_window()
        self._run_started = clock()
        self._paused_s = 0.0
        self.trained_samples = 0
        self._progress = None

    def begin(self, start_step: int) -> None:
        """The run's clock starts (at the step after `start_step`, when resuming)."""
        self._window = self._new_window()
        self._run_started = self.clock()
        self._progress = _progress_bar(self.dist_env, self.max_steps, start_step)

    def _new_window(self) -> _Window:
        return _Window(loss_sum=torch.zeros((), device=self.device), started=self.clock())

    # --- what the step reports ------------------------------------------------------------

    def phase(self, name: str | None, at: float | None = None) -> None:
        """The step enters phase `name` (None: the step is over), now or at an earlier `at`."""
        self.timer.start(name, at)

    def micro_batch(self, lengths: torch.Tensor) -> None:
        """Count a micro-batch's real tokens, its samples' `lengths` (on the host: no sync)."""
        self._window.tokens += int(lengths.sum())
        self._window.sum_sq_len += int(lengths.square().sum())

    def step_done(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.timer.start(None)
        self._window.loss_sum += loss
        self._window.steps += 1
        self._window.grad_norm = grad_norm
        self.trained_samples += self.global_batch
        if self._progress is not None:
            self._progress.update(1)

    def step_skipped(self) -> None:
        self.timer.start(None)
        self._window.skipped += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the body (eval, checkpoints) counts in no rate."""
        started = self.clock()
        try:
            yield
        finally:
            paused = self.clock() - started
            self._window.paused_s += paused
            self._paused_s += paused

    # --- what the loop reads ------------------------------------------------------------

    def take_window(self, epoch: int, lr: float) -> dict[str, float]:
        """Global metrics of the window since the last call, which starts a new one."""
        window, self._window = self._window, self._new_window()
        seconds = self.clock() - window.started - window.paused_s
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
            "mfu": self._mfu(self.flop_model.train_flops(tokens, sum_sq_len) / seconds / world),
            **{f"time/{phase}_s": total / steps for phase, total in self.timer.take().items()},
        }
        if window.grad_norm is not None:
            metrics["grad_norm"] = window.grad_norm.item()
        if window.skipped:
            metrics["skipped_steps"] = window.skipped
        if self.device.type == "cuda":  # how full the GPU is: the batch size's headroom
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _mfu(self, flops_per_device: float) -> float | None:
        """Model FLOP/s over the peak, at most 1 by construction: a device that beat its peak
        shows the peak to be none (a CPU's measured one, slowed by a busy machine), and MFU is
        unknown from then on."""
        if not self.peak:
            return None
        if flops_per_device > self.peak:
            log.warning("MFU unknown from here on: the model ran at %.3g FLOP/s per device, above the peak "
                        "of %.3g, which is thus no peak; train.peak_tflops sets a true one", flops_per_device,
                        self.peak)
            self.peak = None
            return None
        return flops_per_device / self.peak

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
        seconds = self.clock() - self._run_started - self._paused_s
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
