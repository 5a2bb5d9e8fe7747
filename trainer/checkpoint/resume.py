"""Resume: which checkpoint, which config changes it accepts, which global batch.

Decided once, by `decide`, before the data and the model load, so a resume the config can't
make is refused in seconds: another config, a global batch this world size can't split, or a
checkpoint of the other format (DDP's files against FSDP's shards). Every rank decides alone
from the same files (rank 0 chooses the checkpoint and broadcasts it), so every rank refuses
alike, with no other collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.checkpoint import formats
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.store import Store, read_state, verify
from trainer.config import loading, schema
from trainer.config.schema import Config
from trainer.data.batch_plan import BatchPlan
from trainer.errors import CheckpointError, ConfigError
from trainer.model.pretrained import is_model_folder
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.space import SPACE, Labels

log = logging.getLogger(__name__)


class Change(NamedTuple):
    """A config key whose value differs from the resumed checkpoint's."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old} -> {self.new}"


@dataclass(frozen=True)
class ResumePlan:
    batch: BatchPlan
    """The global batch (on resume, the checkpoint's: a run keeps its own), split over this run's ranks."""
    path: Path | None = None
    """The checkpoint to resume from; None: a fresh run."""
    saved: dict | None = None
    """Its train state (state.json: train_state.TrainState)."""
    accepted_changes: list[Change] = field(default_factory=list)
    """Config changes the resume accepted (checkpoint.allow_changes, a longer run): they take effect."""

    @property
    def step(self) -> int:
        """The step the run continues after."""
        return 0 if self.saved is None else self.saved["step"]


def decide(cfg: Config, dist_env: DistEnv, checkpointer: Checkpointer) -> ResumePlan:
    path = choose(cfg.checkpoint.resume, checkpointer.store, dist_env)
    if path is None:
        return ResumePlan(BatchPlan.of(cfg.train, dist_env.world_size))
    _check_format(path, checkpointer.format, cfg)
    saved = read_state(path)
    accepted = _check_config_changes(path, saved, cfg)
    batch = BatchPlan.of(cfg.train, dist_env.world_size, saved["global_batch"])
    if cfg.train.global_batch is None:
        by_keys = BatchPlan.of(cfg.train, dist_env.world_size).global_batch
        if by_keys != batch.global_batch:
            log.warning("the global batch stays the checkpoint's, %d, not train.batch_size x train.grad_accum x "
                        "world size = %d (train.global_batch=%d says so)", batch.global_batch, by_keys,
                        batch.global_batch)
    return ResumePlan(batch, path, saved, accepted)


def labels_on_resume(plan: ResumePlan, labels: Labels) -> Labels:
    """The run's labels: on resume, the checkpoint's. Its label space (the task, the classes
    in id order, how the column stores them) must be the one this run's data and config give,
    or every class could have another id: refused here, before the model loads. Its counts
    and class weights stay the checkpoint's, computed once at the run's start, even where
    checkpoint.allow_changes lets the data change."""
    saved = None if plan.saved is None else plan.saved.get("labels")
    if saved is None:
        return labels
    resumed = Labels.from_state(saved)
    changed = resumed.differences(labels, among=SPACE)
    if changed:
        raise CheckpointError(f"the labels changed from the checkpoint's to what this run's data and config give: "
                              f"{'; '.join(changed)}: resume with the data and labels the run was started on, or "
                              "start over with checkpoint.resume=never")
    if resumed != labels:
        log.info("the labels' counts and class weights stay the checkpoint's, of the data the run started on (%s)",
                 "; ".join(resumed.differences(labels)))
    return resumed


def choose(resume: str, store: Store, dist_env: DistEnv) -> Path | None:
    """The checkpoint checkpoint.resume names (auto: the newest that verifies; never: none),
    chosen by rank 0 and the same on every rank."""
    def choice() -> str | None:
        if resume == "never":
            return None
        if resume != "auto":
            problem = verify(Path(resume))
            if problem:
                raise ConfigError(f"checkpoint.resume: {resume}: {problem}")
            return resume
        newest = store.newest_valid()
        return None if newest is None else str(newest)

    chosen = distributed.rank_zero_does(dist_env, f"checkpoint.resume: {store.root}", choice)
    chosen = distributed.broadcast_from_rank_zero(dist_env, chosen)
    return None if chosen is None else Path(chosen)


def _check_format(path: Path, run_format: formats.Format, cfg: Config) -> None:
    """The checkpoint's format is this run's strategy's: DDP's files and FSDP's shards don't
    convert, even when checkpoint.allow_changes names train.strategy."""
    written = formats.of_checkpoint(path)
    if written is not run_format:
        saved_by = OmegaConf.select(OmegaConf.load(path / "config.yaml"), "train.strategy", default="?")

        def named(strategy: str, fmt: formats.Format) -> str:
            return f"{strategy} (sharded)" if fmt is formats.SHARDED else strategy

        raise CheckpointError(f"checkpoint.resume: {path}: written by train.strategy={named(saved_by, written)}, "
                              f"and this run is {named(cfg.train.strategy, run_format)}: the two formats don't "
                              "convert; resume it with the strategy that wrote it, or start a new output_dir")


def describe(plan: ResumePlan, dist_env: DistEnv) -> None:
    """Log what the resume did, once its checkpoint is loaded."""
    saved = plan.saved
    assert saved is not None, "describe() is called for a resume, whose plan has the saved state"
    log.info("resumed from %s (step %d, epoch %d)", plan.path, saved["step"], saved["epoch"])
    if saved["world_size"] != dist_env.world_size:
        batch = plan.batch
        log.info("resumed at world size %d from a checkpoint of world size %d: the same global batch of %d, now "
                 "%d rank(s) x %d micro-batch(es) of %d; each rank's RNGs are seeded from (seed, step, rank)",
                 dist_env.world_size, saved["world_size"], batch.global_batch, dist_env.world_size,
                 batch.grad_accum, batch.micro_batch)


def _check_config_changes(path: Path, saved: dict, cfg: Config) -> list[Change]:
    """Refuse a resume whose config would silently change the run; return the changes it
    accepts, logged."""
    saved_cfg = cast(DictConfig, OmegaConf.load(path / "config.yaml"))  # written by loading.to_yaml: a mapping
    refused, accepted = config_changes(saved_cfg, cfg)
    reasons = [str(change) for change in refused]
    global_batch = cfg.train.global_batch
    if global_batch is not None and global_batch != saved["global_batch"]:
        # Not even with allow_changes: the data position is counted in global batches.
        reasons.append(f"train.global_batch: {saved['global_batch']} -> {global_batch} (the data position is "
                       "counted in global batches: a run keeps its own)")
    if reasons:
        raise ConfigError(
            f"checkpoint.resume: {path} was written with another config: {'; '.join(reasons)}. Resume with "
            "the checkpoint's values, accept a change with checkpoint.allow_changes=[KEY,...], or start "
            "over with checkpoint.resume=never")
    for change in accepted:
        log.warning("resuming with a changed config: %s", change)
    if any(schema.RESUME_RULES[change.key] == schema.EXTEND for change in accepted):
        log.warning("the run's length changed: the LR schedule is rebuilt for the new step count and continues "
                    "from its value at this step (a warmup given by train.warmup_ratio is of all steps; a "
                    "decaying schedule now ends at the new end, so a longer run's lr is above the old one's)")
    return accepted


def config_changes(saved: DictConfig, cfg: Config) -> tuple[list[Change], list[Change]]:
    """(refused, accepted): each key of `cfg` that differs from the resumed checkpoint's
    config `saved`, split by the key's rule (schema.RESUME_RULES) and
    checkpoint.allow_changes. Keys the saved config doesn't have (an older schema) are not
    changes. A key both configs take from the environment as the same `${oc.env:NAME}` is
    the same: its value is not in the checkpoint (loading.to_yaml) to compare."""
    try:
        old = loading.flatten(loading.to_dict(saved))  # the saved `${oc.env:...}` read from this environment
    except OmegaConfBaseException:  # a variable this environment lacks: compared as written
        old = loading.flatten(loading.written_dict(saved))
    new = loading.flatten(loading.to_dict(cfg))
    old_written, new_written = loading.flatten(loading.written_dict(saved)), loading.flatten(loading.written_dict(cfg))
    refused: list[Change] = []
    accepted: list[Change] = []
    for key in sorted(old.keys() & new.keys()):
        rule = schema.RESUME_RULES.get(key, schema.FIXED)
        if old[key] == new[key] or old_written.get(key) == new_written.get(key) or rule == schema.FREE:
            continue
        change = Change(key, old[key], new[key])
        extended = rule == schema.EXTEND and None not in (old[key], new[key]) and new[key] > old[key]
        if extended or _named(key, cfg.checkpoint.allow_changes):
            accepted.append(change)
        else:
            refused.append(change)
    return refused, accepted


def _named(key: str, entries) -> bool:
    """`key` is one of `entries`, or inside a section among them (`data`)."""
    return any(key == entry or key.startswith(entry + ".") for entry in entries)


def trained_folder(cfg: Config, source: str, key: str = "checkpoint") -> Path:
    """The folder that evaluate's `checkpoint=SOURCE` (score's `score.model`) names: `final`
    (output_dir/final), a model folder written by save_pretrained, or a checkpoint (step-N).
    Checked before any process group exists."""
    path = Path(cfg.output_dir) / "final" if source == "final" else Path(source)
    if not path.is_dir():
        raise ConfigError(f"{key}: {path}: no such folder")
    if is_model_folder(path):
        return path
    problem = verify(path)
    if problem:
        raise ConfigError(f"{key}: {path}: neither a model folder (final/, with config.json) nor a "
                          f"complete checkpoint (step-N): {problem}")
    return path
