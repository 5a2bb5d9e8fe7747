"""The training step: one optimizer step over the micro-batches of a global batch, as every
rank runs it.

Training runs it (trainer/loop.py) and doctor's scaling forecast times it
(trainer/preflight/forecast.py). Both get it from trainer/build.py, so what changes here (the
loss, accumulation, clipping, the loss scaler, the strategy's gradient sync) is timed as it
trains. Whoever runs it watches it through a `StepObserver`: the Meter in training, a clock
that syncs the device at each phase in the forecast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.faults import inject
from trainer.faults.numerics import LossGuard, Outcome
from trainer.model import sdpa_kernel

if TYPE_CHECKING:
    from trainer.strategies.base import Strategy
    from trainer.tasks.base import Task


class LogitsUnderAutocast(nn.Module):
    """The classifier's logits, computed under autocast with the configured dtype in
    whichever thread runs the forward.

    Autocast is thread-local, and nn.DataParallel runs each replica in a thread of its
    own, where it re-enters autocast without a dtype: the device's default, fp16 on CUDA.
    A bf16 run would silently compute in fp16, with no loss scaler. Entered here, inside
    each replica's forward, it is the configured dtype. Logits rather than transformers'
    loss: DataParallel gathers them, and the loss is then taken over the whole batch.
    """

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.model(**inputs).logits


class StepObserver:
    """What the step reports as it runs; this one ignores it all. trainer/metrics.py's Meter
    keeps it as the run's rates and phase times, the forecast's clock as its timings."""

    def micro_batch(self, attention_mask: torch.Tensor) -> None:
        """A micro-batch begins, still on the host."""

    def phase(self, name: str | None, at: float | None = None) -> None:
        """The step enters phase `name` (None: it is over), now or at an earlier `at`
        (time.perf_counter's clock)."""

    def step_done(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """The optimizer step is taken: this rank's loss of it, and `grad_norm` before
        clipping, if computed."""

    def step_skipped(self) -> None:
        """The step was not taken (trainer/faults/numerics.py): nothing of it counts."""


class TrainStep:
    """One optimizer step over grad_accum micro-batches; the result equals one big batch.
    Holds the optimizer, the LR schedule and the fp16 loss scaler it steps, and the guard that
    skips a step whose loss or gradients are not finite."""

    def __init__(self, model: nn.Module, strategy: Strategy, task: Task, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                 guard: LossGuard, max_grad_norm: float, device: torch.device, non_blocking: bool,
                 sdpa_backend: str = "auto"):
        assert strategy.module is not None, "the strategy has parallelized the model"
        self.model, self.strategy, self.module, self.task = model, strategy, strategy.module, task
        self.optimizer, self.scheduler, self.scaler, self.guard = optimizer, scheduler, scaler, guard
        self.max_grad_norm, self.device, self.non_blocking = max_grad_norm, device, non_blocking
        self.sdpa_backend = sdpa_backend

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's loss, through whatever runs the model on this rank: the mean of its
        samples' losses (the task's), in fp32. Over the gathered logits, not as a mean of
        DataParallel's per-replica means, which would weigh the samples of an uneven split (5
        samples on 2 GPUs: 3 and 2) unequally."""
        inputs = dict(batch)
        labels = inputs.pop("labels")
        return self.task.sample_losses(self.module(**inputs), labels).mean()

    def __call__(self, batches: list[dict], step: int, observer: StepObserver) -> Outcome:
        """Optimizer step number `step` over `batches`, this rank's micro-batches of it; taken
        or skipped on every rank alike."""
        grad_accum = len(batches)
        clock = self.strategy.comm_clock
        step_loss = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            observer.micro_batch(batch["attention_mask"])
            # From page-locked memory (data.pin_memory, on GPU) the copies need not block the host.
            batch = {k: v.to(self.device, non_blocking=self.non_blocking) for k, v in batch.items()}
            is_last = i == grad_accum - 1
            with self.strategy.sync_gradients(now=is_last), sdpa_kernel(self.sdpa_backend):
                observer.phase("forward")
                loss = self.loss(batch) / grad_accum
                if i == 0:
                    inject.point("loss", step, loss=loss)
                observer.phase("backward")
                self.scaler.scale(loss).backward()
            if is_last and clock is not None:
                observer.phase("comm", at=clock.take())  # from the last bucket on
            step_loss += loss.detach()
        observer.phase("optimizer")
        self.strategy.gradients_ready()
        inject.point("gradients", step, model=self.model)
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        elif self.guard.enabled:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        # With fp16, a step whose gradients overflowed is skipped by the scaler and the scale
        # halved; every rank skips the same steps, because the all-reduced gradients are the
        # same everywhere. A loss that is not finite, in any precision, the guard skips.
        outcome = self.guard.judge(step_loss, grad_norm, scaler_skips_overflow=self.scaler.is_enabled())
        if outcome.taken:
            self.scaler.step(self.optimizer)
        self.scaler.update()  # also after a skipped step: it ends the step's unscale_
        if outcome.taken:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if outcome.taken:
            observer.step_done(step_loss, grad_norm)
        else:
            self.strategy.discard_gradients()
            observer.step_skipped()
        return outcome
