"""A parallel strategy: how the training step runs the model across ranks. Chosen once from
train.strategy (trainer/strategies/registry.py), then asked by every part that depends on it:
the builder parallelizes the model with it, the step syncs gradients through it, the
checkpointer stores the model in its format, the export writes final/ through it, and the
memory plan counts what one rank holds under it.

`Strategy` is a whole model on every rank, computing on its own batch: what DDP and
DataParallel share. A strategy overrides what it does otherwise.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from trainer.checkpoint import formats
from trainer.config.schema import Config
from trainer.data.batch_plan import BatchPlan
from trainer.data.packing import is_packed
from trainer.model import packing
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import PreTrainedModel

    from trainer.strategies.traffic import Param, Traffic


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
            if is_packed(inputs):  # data.packing: each sample read at its own token of the rows
                return packing.logits(self.model, inputs)
            return self.model(**inputs).logits


class CommClock(Protocol):
    """When the last gradient bucket of the latest backward became ready (None without one):
    whatever backward() took after it is communication that no compute hid (DDP's, ddp.py)."""

    def take(self) -> float | None: ...


@dataclass(frozen=True)
class Parallel:
    """What `Strategy.parallelize` built of a model on this rank."""

    logits: LogitsUnderAutocast
    """The bare model's logits in the run's precision, with no wrapper: what evaluation calls."""
    module: nn.Module
    """What the training step calls for logits: the wrapped model (DDP, DataParallel), or the
    logits themselves."""


class Strategy:
    name: ClassVar[str]
    checkpoint_format: ClassVar[formats.Format] = formats.WHOLE
    """How a checkpoint stores the model (and optimizer) under it."""
    forecast_unsupported: ClassVar[str | None] = None
    """Why doctor's scaling forecast does not model it; None: it does."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sharded = False
        """The model's weights are shards: every rank must run each forward (evaluation), and
        the export gathers them."""
        self.comm_clock: CommClock | None = None
        """When the last gradient bucket became ready, for the exposed-communication phase."""

    # --- before the process group ---------------------------------------------------------

    def check_world_size(self, world_size: int) -> None:
        """What the strategy asks of the world size, checked by each rank before the rendezvous."""
        BatchPlan.of(self.cfg.train, world_size)  # a global batch this world size can't split

    # --- the memory plan --------------------------------------------------------------

    def memory_shards(self, world_size: int) -> int:
        """Over how many ranks the weights, gradients and optimizer state are split."""
        return 1

    def gradient_copies(self) -> int:
        """How many copies of the gradients a rank holds."""
        return 1

    def gathered_bytes(self, model: nn.Module, compute: torch.dtype, world_size: int) -> int:
        """The weights a rank gathers whole for compute at once, beside its own."""
        return 0

    # --- doctor's forecast ----------------------------------------------------------------

    def traffic(self, params: list[Param], backend: str, sparse_rows: float, bucket_cap_mb: float | None = None,
                comm_hook: str | None = None) -> Traffic:
        """What one step puts on the wire per rank (trainer/strategies/traffic.py), for the
        scaling forecast; asked only where `forecast_unsupported` is None."""
        raise NotImplementedError(f"{self.name}: {self.forecast_unsupported}")

    # --- the run ------------------------------------------------------------------------

    def parallelize(self, model: PreTrainedModel, dist_env: DistEnv, device: torch.device, amp_dtype: torch.dtype,
                    group: ProcessGroup | None = None) -> Parallel:
        """Make `model` (the bare one, in place where the strategy shards it) run on this rank
        as the step needs it, over `group` (None: every rank)."""
        self.prepare(model, dist_env, device, amp_dtype)
        logits = LogitsUnderAutocast(model, device.type, amp_dtype)
        return Parallel(logits, self.wrap(logits, dist_env, device, group))

    def prepare(self, model: PreTrainedModel, dist_env: DistEnv, device: torch.device, amp_dtype: torch.dtype) -> None:
        """The bare model, before its logits are wrapped."""

    def wrap(self, logits: nn.Module, dist_env: DistEnv, device: torch.device,
             group: ProcessGroup | None) -> nn.Module:
        """What the step calls for `logits`."""
        return logits

    def sync_gradients(self, now: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward and backward: gradients are reduced across
        ranks only when `now` (the step's last micro-batch), so accumulation costs no extra
        communication."""
        return nullcontext()

    def gradients_ready(self) -> None:
        """After the last backward, before clipping and the optimizer."""

    def discard_gradients(self) -> None:
        """A step was skipped (trainer/faults/numerics.py): nothing of its gradients, which may
        be NaN, may reach a later step through state the strategy keeps across steps."""

    def states(self) -> dict[str, Stateful]:
        """What a checkpoint keeps of the strategy itself, by name."""
        return {}

    # --- final/ -----------------------------------------------------------------------

    def gathered_trained_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: the trained weights whole, where the model holds shards; None: the
        model's own are whole."""
        return None

    def save_pretrained(self, model: PreTrainedModel, folder: Path, dist_env: DistEnv) -> None:
        """Collective: `model` as transformers' save_pretrained writes it, into `folder`
        (rank 0's, which exists). Whole: rank 0 saves it."""
        distributed.rank_zero_does(dist_env, f"output_dir: {folder}", lambda: model.save_pretrained(folder))
