"""Steps that go wrong without failing: a loss or gradient that is not finite, and loss spikes.

A NaN or an Inf in bf16 or fp32 (which have no loss scaler) would reach AdamW unchecked:
clip_grad_norm_ returns the NaN norm, the weights become NaN, and every later step and
checkpoint carries them, while the run ends "done". So every step ends in a check:

- `LossGuard`, inside the step (trainer/train/step.py): one all-reduce of the step's loss and
  gradient norm, decided on the device, so that every rank takes the same decision; the host
  reads it a step later, when it has long arrived (trainer/train/step.py says how). A step whose
  loss or gradient norm is not finite on any rank is skipped on every rank: no optimizer
  update, no LR schedule step, and the batch is not trained on. Under fp16 the loss scaler
  keeps its own rule for gradients that overflow (a step skipped, the scale halved); a loss
  that is not finite is a bad step there too.
- `BadSteps`, in the loop (trainer/train/loop.py): the same step is tried again with the next
  batch. After fault.max_bad_steps failed tries of one step in a row, the run rolls back to
  its newest checkpoint and goes on with the batches after the bad ones (as OPT, BLOOM and OLMo
  got past their divergences by hand). If that step fails as often again, the run stops
  (exit 77: a restart would only read the same data again), naming the step and the data
  position of its batches. A finite loss far above the recent median (fault.spike_factor) is
  logged with its batch's position; fault.rollback_on_spike treats it as a bad step.

Every bad step and spike is also a line of output_dir/bad-batches.jsonl: the step, why, and
the batch's data position (epoch, its samples in the epoch's order, the train split's rows).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer.config.schema import FaultConfig
from trainer.errors import NoProgress
from trainer.runtime.environment import DistEnv

log = logging.getLogger(__name__)

SPIKE_WINDOW = 100
"""The recent losses a spike is measured against: the last this many steps taken..."""
SPIKE_MIN_STEPS = 20
"""...once there are at least this many."""


class Outcome(NamedTuple):
    """What the step's check found, the same on every rank."""

    taken: bool
    """Whether the optimizer stepped."""
    loss: float | None
    """The step's loss, the mean over ranks (None: the check is off)."""
    grad_norm: float | None
    """The gradient norm before clipping (None: not computed)."""
    bad: str | None = None
    """Why the step is bad: "non-finite loss", "non-finite gradient norm", "loss spike"."""
    spike: float | None = None
    """The loss over the recent median, when it is a spike."""


class LossGuard:
    """The step's check: one all-reduce of (loss, gradient norm) over `group`, decided on the
    device (`check`); the host reads the decision once its copy has arrived (`Verdict.read`)."""

    def __init__(self, fault_cfg: FaultConfig, dist_env: DistEnv, group: dist.ProcessGroup | None = None):
        self.dist_env, self.group = dist_env, group
        self.spike_factor = fault_cfg.spike_factor
        self.rollback_on_spike = fault_cfg.rollback_on_spike
        self.check_finite = fault_cfg.max_bad_steps > 0
        self.enabled = self.check_finite or self.spike_factor > 0
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, scaler_skips_overflow: bool) -> Outcome:
        """`check`, then `Verdict.read` at once: the host waits for the device."""
        return self.check(loss, grad_norm, scaler_skips_overflow).read()

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, scaler_skips_overflow: bool) -> Verdict:
        """Collective over the group: `loss` is this rank's share of the step's loss (a 0-dim
        tensor), `grad_norm` the norm of the synchronized gradients (the same on every rank).
        With the check off, a verdict of a step taken. Nothing here waits for the device:
        `Verdict.skip` says on the device whether the step is bad (the same on every rank: it
        is computed from the all-reduced numbers), and the numbers travel to the host behind
        the device's work."""
        if not self.enabled:
            return Verdict(self, loss, grad_norm)
        norm = _full(grad_norm) if grad_norm is not None else torch.zeros((), device=loss.device)
        values = torch.stack([loss.detach().float(), norm.detach().float().to(loss.device)])
        ranks = 1
        if self.dist_env.is_distributed:
            dist.all_reduce(values, group=self.group)
            ranks = dist.get_world_size(self.group)
        skip = torch.zeros((), device=values.device)
        if self.check_finite:  # as `_decide` decides on the host, from the same sums
            bad = ~torch.isfinite(values[0])
            if grad_norm is not None and not scaler_skips_overflow:
                bad = bad | ~torch.isfinite(values[1])
            skip = bad.float()
        return Verdict(self, loss, grad_norm, values, skip, ranks, scaler_skips_overflow)

    def _decide(self, loss_sum: float, norm_sum: float, ranks: int, has_norm: bool,
                scaler_skips_overflow: bool) -> Outcome:
        mean_loss, mean_norm = loss_sum / ranks, norm_sum / ranks if has_norm else None
        why = "non-finite loss" if not math.isfinite(mean_loss) else \
            "non-finite gradient norm" if mean_norm is not None and not math.isfinite(mean_norm) \
            and not scaler_skips_overflow else None
        if why is not None:  # with fault.max_bad_steps=0 trained on, as before the check
            return Outcome(False, mean_loss, mean_norm, why) if self.check_finite else \
                Outcome(True, mean_loss, mean_norm)
        spike = self._spike(mean_loss)
        if spike is not None and self.rollback_on_spike:
            return Outcome(False, mean_loss, mean_norm, "loss spike", spike)
        self.recent.append(mean_loss)
        return Outcome(True, mean_loss, mean_norm, None, spike)

    def _spike(self, loss: float) -> float | None:
        if self.spike_factor <= 0 or len(self.recent) < SPIKE_MIN_STEPS:
            return None
        median = statistics.median(self.recent)
        return loss / median if median > 0 and loss > self.spike_factor * median else None


class Verdict:
    """A step's check, decided on the device and on its way to the host: the one account of
    a try that the host reads (`read`), a step later where it may (trainer/train/step.py).

    `skip` (a 0-dim float on the device, 1: bad; None: the check is off) is what the fused
    AdamW takes as its `found_inf`, as GradScaler hands it over: a bad step changes no weight
    and no moment, with no host involved. The sums are copied to the host without blocking it,
    behind the step's work: `read` (once; later calls return the same) waits for that copy
    alone, which a step later has long arrived, so the host never waits for the device's queue
    to drain. `loss` and `grad_norm` are this rank's, on the device, for the step's observer."""

    def __init__(self, guard: LossGuard, loss: torch.Tensor, grad_norm: torch.Tensor | None,
                 values: torch.Tensor | None = None, skip: torch.Tensor | None = None, ranks: int = 1,
                 scaler_skips_overflow: bool = False):
        self.guard, self.loss, self.grad_norm, self.skip = guard, loss, grad_norm, skip
        self.ranks, self.scaler_skips_overflow, self.has_norm = ranks, scaler_skips_overflow, grad_norm is not None
        self._outcome: Outcome | None = None
        if values is None or skip is None:  # the check is off: taken, nothing to read
            self._outcome = Outcome(True, None, None)
            return
        self._host = torch.cat([values, skip.reshape(1)]).to("cpu", non_blocking=True)  # pinned, on CUDA
        self._arrived = None
        if values.device.type == "cuda":
            self._arrived = torch.cuda.Event()
            self._arrived.record()

    def read(self) -> Outcome:
        if self._outcome is None:
            if self._arrived is not None:
                self._arrived.synchronize()  # the copy's event, not the queue's end
            loss_sum, norm_sum, skip = self._host.tolist()
            self._outcome = self.guard._decide(loss_sum, norm_sum, self.ranks, self.has_norm,
                                               self.scaler_skips_overflow)
            if self._outcome.bad != "loss spike" and self._outcome.taken != (skip == 0):
                raise AssertionError(f"the device and the host judged the step differently: {skip} vs {self._outcome}")
        return self._outcome


def _full(norm: torch.Tensor) -> torch.Tensor:
    """FSDP's clip_grad_norm_ returns a DTensor: the norm of every shard together."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm


class NonFiniteTraining(NoProgress):
    """A step stayed bad after a rollback: exit 77, since a restart reads the same batches."""


class NonFiniteWeights(RuntimeError):
    """The weights are not finite before a save: they must not become a checkpoint. A crash
    (retryable): the launcher restarts from the last checkpoint, which holds finite weights."""


class BadSteps:
    """The loop's account of bad steps: skip, roll back or stop; the counts in metrics and
    the summary. Saved with the train state (a rollback keeps the live counts)."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.skipped = 0
        """Step tries skipped in the whole run."""
        self.spikes = 0
        self.rollbacks = 0
        self.streak = (0, 0)
        """(step, failed tries of it in a row)."""
        self.rolled_back_for: list[int] = []
        """The steps whose failures rolled the run back."""

    def observe(self, step: int, outcome: Outcome, where: str) -> bool:
        """Account for `outcome` of a try of `step` on the batch at `where`. Returns whether
        to roll back; raises NonFiniteTraining when the step fails again after a rollback."""
        numbers = f"loss {outcome.loss:.6g}" + ("" if outcome.grad_norm is None else
                                                 f", gradient norm {outcome.grad_norm:.6g}")
        if outcome.taken:  # a spike, logged
            self.spikes += 1
            log.warning("step %d: loss spike, %.1fx the recent median (%s) on %s", step, outcome.spike, numbers,
                        where)
            return False
        self.skipped += 1
        tries = self.streak[1] + 1 if self.streak[0] == step else 1
        self.streak = (step, tries)
        log.warning("step %d: %s (%s) on %s: skipped on every rank, %d of %d tries in a row", step, outcome.bad,
                    numbers, where, tries, self.max_bad_steps)
        if self.max_bad_steps == 0 or tries < self.max_bad_steps:  # 0: only spikes are checked, never skipped
            return False
        if step in self.rolled_back_for:
            raise NonFiniteTraining(
                f"step {step} failed {tries} tries in a row again after a rollback ({outcome.bad}, the last on "
                f"{where}): the model, not one batch, is the problem; look at bad-batches.jsonl in output_dir, "
                "lower train.lr or raise warmup, and resume from a checkpoint")
        self.rolled_back_for.append(step)
        self.rollbacks += 1
        self.streak = (0, 0)
        return True

    def summary(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped, "rollbacks": self.rollbacks, "loss_spikes": self.spikes}

    def state_dict(self) -> dict:
        return {**self.summary(), "rolled_back_for": list(self.rolled_back_for)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.rollbacks = state.get("skipped_steps", 0), state.get("rollbacks", 0)
        self.spikes, self.rolled_back_for = state.get("loss_spikes", 0), list(state.get("rolled_back_for", []))
        self.streak = (0, 0)


def check_weights(model: torch.nn.Module, dist_env: DistEnv) -> None:
    """Collective: raises NonFiniteWeights on every rank if any rank holds a trained weight
    that is not finite (its own shard, under FSDP). The frozen ones are as loaded. One host
    sync for all of them."""
    trained = [(name, _local(p)) for name, p in model.named_parameters() if p.requires_grad]
    finite = torch.stack([torch.isfinite(p).all() for _, p in trained]) if trained else None
    flag = torch.zeros(1, device=next(model.parameters()).device)  # the collective's device: NCCL's or gloo's
    if finite is not None:
        flag += (~finite).any().float()
    if dist_env.is_distributed:
        dist.all_reduce(flag)
    if flag.item():
        bad = [name for (name, _), ok in zip(trained, finite.tolist(), strict=True) if not ok] if finite is not None \
            else []
        raise NonFiniteWeights(f"the weights are not finite ({bad[0] if bad else 'on another rank'}): not saved; the "
                               "newest checkpoint holds finite weights")


def _local(p: torch.Tensor) -> torch.Tensor:
    local = getattr(p, "to_local", None)
    return local() if local is not None else p
