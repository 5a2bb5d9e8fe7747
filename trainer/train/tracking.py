"""Metrics: wandb on global rank 0 (offline unless asked), plus files that need no service.

- `output_dir/config.yaml`: the resolved config (a value from the environment as written,
  `${oc.env:NAME}`: loading.to_yaml), written as a fresh run starts.
- `output_dir/metrics.jsonl`: one JSON object per log step, the same numbers sent to wandb.
- `output_dir/tensorboard/`: the same again as TensorBoard events (tracking.tensorboard).
- `output_dir/bad-batches.jsonl`: each step try skipped as not finite, and each loss spike.
- `output_dir/summary.json`: the final figures of the run (trainer/outputs/summary.py).

Values arriving here are already global (all-reduced by the loop): this module never sees
a rank-local loss. Other ranks get a Tracker that does nothing, so callers need no rank checks.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from trainer import files
from trainer.config import loading
from trainer.config.schema import Config
from trainer.errors import describe
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


def start_output_dir(output_dir: Path, config_yaml: str) -> None:
    """Rank 0, as a fresh run starts: output_dir created (files.make_writable_dir says why it
    can't be) and the resolved config in it."""
    files.make_writable_dir(output_dir)
    files.write_text(output_dir / "config.yaml", config_yaml)


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(4)


class Tracker:
    """Made with the Trainer, once; `start`ed when the run knows where it starts (a resume's
    step and wandb run), before anything is logged."""

    def __init__(self, cfg: Config, dist_env: DistEnv):
        self.cfg, self.dist_env = cfg, dist_env
        self.enabled = dist_env.is_rank_zero
        self.output_dir = Path(cfg.output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self._wandb_run = None
        self._tensorboard: SummaryWriter | None = None
        self.tensorboard = cfg.tracking.tensorboard

    def start(self, run_id: str, resume_step: int) -> None:
        """Rank 0 opens what it writes to: metrics.jsonl cut back to `resume_step`, wandb's
        run `run_id` (continued on a resume), TensorBoard's events."""
        cfg = self.cfg

        def start() -> None:
            self._truncate_metrics(resume_step)
            if cfg.wandb.mode != "disabled":
                self._wandb_run = self._start_wandb(cfg, run_id)
            self._start_tensorboard(resume_step)

        # Rank 0's disk or wandb failing stops every rank now, not at the next collective.
        distributed.rank_zero_does(self.dist_env, f"wandb ({cfg.wandb.mode}) in {self.output_dir}", start)

    def _truncate_metrics(self, resume_step: int) -> None:
        """On resume, forget lines logged after the checkpoint: those steps are redone."""
        if not self.enabled or not self.metrics_path.exists():
            return
        kept = [
            line for line in self.metrics_path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= resume_step
        ]
        files.write_text(self.metrics_path, "".join(line + "\n" for line in kept))

    def _start_tensorboard(self, resume_step: int) -> None:
        """tracking.tensorboard: event files in output_dir/tensorboard. From a resume (or a
        rollback) at step N, TensorBoard drops what was logged after N: the steps redone
        replace them, and each curve stays one line."""
        if not self.tensorboard:
            return
        if self._tensorboard is not None:
            self._tensorboard.close()
        from torch.utils.tensorboard import SummaryWriter

        self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"),
                                          purge_step=resume_step + 1 if resume_step else None)

    def _start_wandb(self, cfg: Config, run_id: str):
        import wandb  # imported on rank 0 only: it is slow to import and starts a service

        return wandb.init(
            mode=cfg.wandb.mode,
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            name=cfg.wandb.name,
            tags=list(cfg.wandb.tags),
            id=run_id,
            resume="allow",  # the same id after a restart continues the same run
            dir=str(self.output_dir),
            config=loading.written_dict(cfg),  # `${oc.env:NAME}` as written, not its value
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False),
        )

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, step)
        self._to_wandb(lambda run: run.log(metrics, step=step))

    def forget_after(self, step: int) -> None:
        """A rollback to `step`: the steps after it are redone, as on a resume."""
        self._truncate_metrics(step)
        if self.enabled:
            self._start_tensorboard(step)

    def record_bad_batch(self, record: dict) -> None:
        """A line of bad-batches.jsonl: a step that was skipped or spiked, and its batch."""
        if self.enabled:  # JSON has no NaN: a number that is not finite is written as text, "nan"
            record = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            with (self.output_dir / "bad-batches.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    def summary(self, summary: dict) -> None:
        if not self.enabled:
            return
        files.write_text(self.output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self._to_wandb(lambda run: run.summary.update(loading.flatten(summary)))

    def close(self, exit_code: int = 0) -> None:
        self._to_wandb(lambda run: run.finish(exit_code=exit_code))
        self._wandb_run = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _to_wandb(self, send) -> None:
        """Send to wandb; if its service is gone, warn once and go on without it.

        Slurm's scancel and preemption signal every process of a job step, wandb's service
        too, which exits on SIGTERM while the ranks are still on their way to the agreed
        checkpoint. Losing wandb must not turn that save into a crash; metrics.jsonl, written
        above, keeps every step, and the resumed job continues the same wandb run.
        """
        if self._wandb_run is None:
            return
        try:
            send(self._wandb_run)
        except Exception as e:  # wandb's service may die in any way; training goes on  # noqa: BLE001
            log.warning("wandb: run %s lost its service (%s); continuing without wandb, "
                        "metrics.jsonl has every step", self._wandb_run.id, describe(e))
            self._wandb_run = None
