"""The training step: one optimizer step over the micro-batches of a global batch, as every
rank runs it.

Training runs it (trainer/train/loop.py) and doctor's scaling forecast times it
(trainer/preflight/forecast.py). Both get it from trainer/train/build.py, so what changes here (the
loss, accumulation, clipping, the loss scaler, the strategy's gradient sync) is timed as it
trains. Whoever runs it watches it through a `StepObserver`: the Meter in training, a clock
that syncs the device at each phase in the forecast.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from trainer.data.packing import is_packed
from trainer.faults.numerics import LossGuard, Outcome, Verdict
from trainer.model.pretrained import sdpa_kernel

if TYPE_CHECKING:
    from trainer.strategies.base import Strategy
    from trainer.tasks.base import Task


class AttentionMasks:
    """The attention mask a micro-batch hands the model, made so that the model need not read it.

    On every forward, transformers' masking_utils asks an encoder's mask `padding_mask.all()`
    (to leave the mask out when nothing is padded, so that SDPA may pick its fastest kernel):
    a host sync per forward. The host knows the answer from its own copy of the batch: no
    mask when nothing is padded, and otherwise the mask transformers would make, by its own
    create_bidirectional_mask told not to look, which the model takes as made (a 4D mask).
    The same mask in both cases, so the same numbers. For the encoders under SDPA whose mask
    is that function's (others get their 2D mask, as before)."""

    ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "electra", "camembert"})

    def __init__(self, model: nn.Module):
        config = getattr(model, "config", None)
        self.config = config
        self.makes = (config is not None and getattr(config, "model_type", None) in self.ENCODERS
                      and not getattr(config, "is_decoder", False)
                      and not getattr(config, "add_cross_attention", False)
                      and getattr(config, "_attn_implementation", None) == "sdpa")

    def __call__(self, host_mask: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """What to hand the model for the device's copy of `host_mask` (the loader's)."""
        if not self.makes:
            return lambda mask: mask
        if bool(host_mask.all()):  # the host's own memory: no sync
            return lambda mask: None
        return self._made

    def _made(self, mask: torch.Tensor) -> torch.Tensor | None:
        from transformers.masking_utils import create_bidirectional_mask

        shape = torch.empty((*mask.shape, 0), device=mask.device)  # its batch, length and device are read
        return create_bidirectional_mask(self.config, shape, mask, allow_is_bidirectional_skip=False)


class StepObserver:
    """What the step reports as it runs; this one ignores it all. trainer/train/metrics.py's Meter
    keeps it as the run's rates and phase times, the forecast's clock as its timings."""

    def micro_batch(self, lengths: torch.Tensor) -> None:
        """A micro-batch of samples of these token `lengths` begins, still on the host."""

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

    def __init__(self, model: nn.Module, strategy: Strategy, module: nn.Module, task: Task,
                 optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                 guard: LossGuard, max_grad_norm: float, device: torch.device, non_blocking: bool,
                 sdpa_backend: str = "auto", recomputes: bool = False):
        # `module`: what the strategy wrapped the model in (Strategy.parallelize); `model`: the bare one.
        self.model, self.strategy, self.module, self.task = model, strategy, module, task
        self.optimizer, self.scheduler, self.scaler, self.guard = optimizer, scheduler, scaler, guard
        self.max_grad_norm, self.device, self.non_blocking = max_grad_norm, device, non_blocking
        self.sdpa_backend, self.recomputes = sdpa_backend, recomputes
        self.pending: tuple[Verdict, StepObserver] | None = None
        """The last try's verdict, while the host has not read it, and who hears of it."""
        # The host need not wait for the check where the device can apply it: the fused AdamW
        # takes a found_inf. fp16's scaler reads its own found_inf on the host, PowerSGD's
        # error feedback would carry a bad step's NaN into the next backward before its
        # verdict is read, and a spike's median is the host's.
        self.lazy = (guard.enabled and bool(optimizer.defaults.get("fused")) and not scaler.is_enabled()
                     and not guard.rollback_on_spike and getattr(strategy, "powersgd", None) is None)
        self.masks = AttentionMasks(model)
        self.unlearnt = task.unlearnt(model)
        """Parameters whose gradient is rounding alone (the task's): no optimizer step moves them."""

    def loss(self, batch: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """The batch's loss, through whatever runs the model on this rank: the mean of its
        samples' losses (the task's), in fp32. Over the gathered logits, not as a mean of
        DataParallel's per-replica means, which would weigh the samples of an uneven split (5
        samples on 2 GPUs: 3 and 2) unequally."""
        inputs = dict(batch)
        labels = inputs.pop("labels")
        assert labels is not None
        return self.task.sample_losses(self.task.per_sample(self.module(**inputs)), labels).mean()

    def __call__(self, batches: list[dict], step: int, observer: StepObserver) -> Tried:
        """Optimizer step number `step` over `batches`, this rank's micro-batches of it; taken
        or skipped on every rank alike.

        Where the optimizer is the fused AdamW (and neither fp16's scaler nor PowerSGD nor
        fault.rollback_on_spike needs the host to decide), the host never waits for the device:
        the check is decided and applied there (numerics.Verdict), and the host reads its
        verdict a step later, once the next try's forward and backward are queued. A try after
        a bad one is then aborted before its optimizer step, its random state given back, and
        its batches go again (`Tried.aborted`): what it trains is what a host that had waited
        would have trained. `settle` reads a verdict at once, where the caller needs it now."""
        rng = _rng_state(self.device) if self.pending is not None else None
        step_loss = self._forward_backward(batches, observer)
        # Before the optimizer's phase: the observer hears of the last try's end (which ends a
        # phase) before this try's optimizer is timed.
        previous = self.settle()
        if previous is not None and not previous.taken:  # this try is not the one that comes next
            self.optimizer.zero_grad(set_to_none=True)
            _set_rng_state(self.device, rng)
            observer.phase(None)
            return Tried(previous, None)
        observer.phase("optimizer")
        verdict = self._optimizer_step(step, step_loss)
        self.optimizer.zero_grad(set_to_none=True)
        if self.lazy:  # read with the next try's, or by `settle`
            observer.phase(None)
            self.pending = (verdict, observer)
            return Tried(previous, None)
        self._conclude(verdict, observer)
        return Tried(previous, verdict.read())

    def _forward_backward(self, batches: list[dict], observer: StepObserver) -> torch.Tensor:
        """The micro-batches' forward and backward, the gradients synchronized after the last;
        returns this rank's loss of the step (on the device)."""
        grad_accum = len(batches)
        clock = self.strategy.comm_clock
        step_loss = torch.zeros((), device=self.device)
        with self._casts_kept(grad_accum):
            for i, batch in enumerate(batches):
                if is_packed(batch):  # its mask is made on the device, of its sequence ids
                    batch = dict(batch)
                    lengths, mask = batch.pop("lengths"), None
                else:
                    lengths = batch["attention_mask"].sum(1)
                    mask = self.masks(batch["attention_mask"])  # from the host's copy: nothing to read on the device
                observer.micro_batch(lengths)
                # From page-locked memory (data.pin_memory, on GPU) the copies need not block the host.
                batch = {k: v.to(self.device, non_blocking=self.non_blocking) for k, v in batch.items()}
                if mask is not None:
                    batch["attention_mask"] = mask(batch["attention_mask"])
                is_last = i == grad_accum - 1
                with self.strategy.sync_gradients(now=is_last), sdpa_kernel(self.sdpa_backend, backward=True):
                    observer.phase("forward")
                    loss = self.loss(batch) / grad_accum
                    observer.phase("backward")
                    self.scaler.scale(loss).backward()
                if is_last and clock is not None:
                    observer.phase("comm", at=clock.take())  # from the last bucket on
                step_loss += loss.detach()
        return step_loss

    def _optimizer_step(self, step: int, step_loss: torch.Tensor) -> Verdict:
        """The gradients unscaled, clipped and checked, and the optimizer's step taken unless
        the check says the step is bad. Lazily (`lazy`), the fused AdamW skips on the device;
        otherwise the host reads the verdict first."""
        self.gradients_ready(step, step_loss)
        for parameter in self.unlearnt:  # AdamW would step on a gradient of rounding alone
            parameter.grad = None
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        elif self.guard.enabled:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        # With fp16, a step whose gradients overflowed is skipped by the scaler and the scale
        # halved; every rank skips the same steps, because the all-reduced gradients are the
        # same everywhere. A loss that is not finite, in any precision, the guard skips.
        verdict = self.guard.check(step_loss, grad_norm, scaler_skips_overflow=self.scaler.is_enabled())
        if self.lazy:
            assert verdict.skip is not None, "a lazy step is checked"
            _step_unless(self.optimizer, verdict.skip)
            return verdict
        if verdict.read().taken:
            self.scaler.step(self.optimizer)
        self.scaler.update()  # also after a skipped step: it ends the step's unscale_
        return verdict

    def gradients_ready(self, step: int, step_loss: torch.Tensor) -> None:
        """After the last backward, before the gradients are unscaled and clipped: the
        strategy's moment. A test's fault that poisons the loss or the gradients wraps this
        (trainer/faults/inject.py's `into_step`): nothing of it is in a run's own step."""
        self.strategy.gradients_ready()

    def _casts_kept(self, micro_batches: int) -> AbstractContextManager:
        """Autocast casts each trained fp32 weight to the compute dtype and keeps the copy until
        its outermost region ends. Held open (but off) over the micro-batches, a region makes
        that cast once a step instead of once a micro-batch: the same bits, fewer kernels. It
        ends before the optimizer changes the weights in place. Not where activations are
        recomputed (model.gradient_checkpointing): there the copies would outlive each block's
        backward, up to 2 bytes a trained weight more at the peak."""
        if micro_batches > 1 and not self.recomputes:
            return torch.autocast(self.device.type, enabled=False)
        return nullcontext()

    def settle(self) -> Outcome | None:
        """The verdict of the last try, if not read yet: read now, and what the host does
        after a step (the LR schedule's step, the observer told) done. None: none pending."""
        if self.pending is None:
            return None
        (verdict, observer), self.pending = self.pending, None
        self._conclude(verdict, observer)
        return verdict.read()

    def settled(self, batches: list[dict], step: int, observer: StepObserver) -> Outcome:
        """A try whose verdict the caller reads at once (the forecast's timing, tests): the
        host waits for the device."""
        tried = self(batches, step, observer)
        assert not tried.aborted, "no verdict was pending before this try"
        outcome = tried.outcome if tried.outcome is not None else self.settle()
        assert outcome is not None, "a try that was not aborted has a verdict"
        return outcome

    def _conclude(self, verdict: Verdict, observer: StepObserver) -> None:
        if verdict.read().taken:
            self.scheduler.step()
            observer.step_done(verdict.loss, verdict.grad_norm)
        else:
            self.strategy.discard_gradients()
            observer.step_skipped()


class Tried(NamedTuple):
    """What a call of TrainStep did."""

    previous: Outcome | None
    """The verdict of the try before, read during this one; None: it had been read."""
    outcome: Outcome | None
    """This try's verdict; None where it was aborted, or is still on its way to the host
    (TrainStep.settle reads it)."""

    @property
    def aborted(self) -> bool:
        """The try before was bad: this one took no step, and its batches go again."""
        return self.previous is not None and not self.previous.taken


def _step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()`, which the fused AdamW skips on the device where `skip` is 1: it
    reads `found_inf` from itself, where GradScaler puts it for the same purpose (torch.optim's
    `_step_supports_amp_scaling` protocol)."""
    optimizer.__dict__["found_inf"] = skip
    try:
        optimizer.step()
    finally:
        del optimizer.__dict__["found_inf"]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a try's forward draws dropout from (host-side: no device sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    if state is not None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
