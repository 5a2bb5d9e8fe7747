"""Where the run is: what a checkpoint holds beside the model, optimizer and LR schedule.

One `Stateful` object (state_dict / load_state_dict), saved as the checkpoint's state.json
and read back only through it: the step and epoch, the global data position with its
ledger, the batches skipped and the count of bad steps, the batch plan, the wandb run id,
the model selection and early stopping's count, the last validation, and the label space
(its class names, counts and weights). The fp16 loss scaler, a torch Stateful of its own, is
saved beside the optimizer.
"""

from __future__ import annotations

from trainer.data import loaders
from trainer.data.batch_plan import BatchPlan
from trainer.data.loaders import Data
from trainer.faults.numerics import BadSteps
from trainer.runtime.environment import DistEnv
from trainer.tasks.space import Labels
from trainer.train.policy import Selection


class TrainState:
    def __init__(self, batch: BatchPlan, run_data: Data, selection: Selection,
                 dist_env: DistEnv, run_id: str, labels: Labels, bad_steps: BadSteps):
        self.batch, self.data, self.selection, self.labels = batch, run_data, selection, labels
        self.bad_steps = bad_steps
        self.world_size = dist_env.world_size
        self.step = 0
        """The last optimizer step done."""
        self.epoch = 0
        self.skipped_batches = 0
        """Global batches read that no step trained on: tries of a bad step, and the steps a
        rollback undid. The data position is step + skipped_batches."""
        self.run_id = run_id
        """The wandb run's id: a resumed job continues the same wandb run."""
        self.last_eval: tuple[int, dict] | None = None
        """The latest validation (step, metrics): the end of the run reuses it if it is the
        last step's (an early stop), also after a resume from that step."""

    @property
    def batches_read(self) -> int:
        """Global batches read so far: the data position."""
        return self.step + self.skipped_batches

    def state_dict(self) -> dict:
        step, batch = self.step, self.batch
        return {
            "step": step,
            "epoch": self.epoch,
            "step_in_epoch": self.batches_read - self.epoch * self.data.steps_per_epoch,
            "samples_seen": step * batch.global_batch,
            "skipped_batches": self.skipped_batches,
            "bad_steps": self.bad_steps.state_dict(),
            "data": loaders.position(self.data, self.batches_read),  # the global position, and its ledger
            "world_size": self.world_size,
            "global_batch": batch.global_batch,
            "micro_batch": batch.micro_batch,
            "grad_accum": batch.grad_accum,
            "wandb_run_id": self.run_id,
            "selection": self.selection.state_dict(),
            "last_eval": self.last_eval,
            "labels": self.labels.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Raises CheckpointError if its sampler's data position is not the saved one (the
        labels were held to the checkpoint's by resume.labels_on_resume, before the model loaded)."""
        skipped = state.get("skipped_batches", 0)
        loaders.check_position(self.data, state.get("data"), state["step"] + skipped)
        self.step, self.epoch, self.run_id = state["step"], state["epoch"], state["wandb_run_id"]
        self.skipped_batches = skipped
        self.bad_steps.load_state_dict(state.get("bad_steps", {}))
        self.selection.load_state_dict(state.get("selection", {}))
        self.last_eval = tuple(state["last_eval"]) if state.get("last_eval") else None
