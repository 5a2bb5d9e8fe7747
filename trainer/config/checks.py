"""What the keys ask of each other, checked as the config loads: each mistake one line that
names the key (`ConfigError`, exit code 2). What a key asks of the chosen task or strategy
is theirs to check (trainer/cli/run_config.py asks them).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError

_UNKNOWN = object()


LOCAL_PATHS = ("model.name", "data.path")
"""The keys whose local files a command reads, checked where they look local: `score` reads
neither (score.model holds the model, score.input the corpus), so it checks none."""


def check(cfg: DictConfig, local_paths: Sequence[str] = LOCAL_PATHS) -> None:
    """Raise a ConfigError for the first key that another contradicts."""
    train, ckpt = cfg.train, cfg.checkpoint
    if (train.max_steps is None) == (train.epochs is None):
        given = "both are set" if train.max_steps is not None else "neither is set"
        raise ConfigError(f"train.max_steps, train.epochs: set exactly one of them ({given})")
    if train.global_batch is not None and train.grad_accum is not None:
        raise ConfigError("train.grad_accum, train.global_batch: set one of them (with a global batch, the "
                          "accumulation follows from it, train.batch_size and the world size)")
    if cfg.data.folds is not None and cfg.data.fold >= cfg.data.folds:
        raise ConfigError(f"data.fold: must be below data.folds ({cfg.data.folds}), got {cfg.data.fold}")
    if train.early_stopping_patience and not train.eval_every:
        raise ConfigError("train.early_stopping_patience: needs train.eval_every (a step count or epoch)")
    for key in cfg.checkpoint.allow_changes:
        if OmegaConf.select(cfg, key, default=_UNKNOWN) is _UNKNOWN:
            raise ConfigError(f"checkpoint.allow_changes: {key!r} is not a config key")
    _check_labels(cfg)
    if ckpt.export_adapter and cfg.model.lora.r is None:
        raise ConfigError("checkpoint.export_adapter: needs model.lora.r (without LoRA there is no adapter)")
    if cfg.model.sdpa_backend == "flash" and not cfg.data.packing:
        # Seen on an H200 (benchmarks/RESULTS.md, 2026-11-28): "No available kernel" in the first step.
        raise ConfigError("model.sdpa_backend: flash takes no attention mask, and every padded batch "
                          "carries one; set data.packing=true (its rows need none), or use efficient or cudnn")
    if cfg.model.sdpa_backend == "flash" and train.precision == "fp32":
        raise ConfigError("model.sdpa_backend: flash computes in bf16 or fp16 only, but train.precision is fp32")
    if cfg.model.sdpa_backend != "auto" and cfg.model.attn_implementation not in ("auto", "sdpa"):
        raise ConfigError(f"model.sdpa_backend: {cfg.model.sdpa_backend} picks an SDPA kernel, but "
                          f"model.attn_implementation is {cfg.model.attn_implementation}; set it to sdpa")
    if cfg.model.dtype == "bf16":
        if cfg.model.lora.r is None:
            raise ConfigError("model.dtype: bf16 stores the frozen weights of a LoRA run; without model.lora.r "
                              "every weight trains, in fp32")
        if train.precision in ("fp32", "fp16"):
            raise ConfigError(f"model.dtype: bf16 weights need bf16 compute, but train.precision is "
                              f"{train.precision}")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).is_dir():
        raise ConfigError(f"checkpoint.resume: {resume}: expected auto, never or a checkpoint folder")
    for name in cfg.fault.preempt_signals:
        if not isinstance(getattr(signal, name, None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"fault.preempt_signals: {name!r} is not a signal that can be caught")
    if cfg.fault.rollback_on_spike and (cfg.fault.max_bad_steps == 0 or cfg.fault.spike_factor == 0):
        raise ConfigError("fault.rollback_on_spike: needs fault.max_bad_steps > 0 and fault.spike_factor > 0")
    if cfg.hub.push_at_end and not cfg.hub.repo_id:
        raise ConfigError("hub.push_at_end: needs hub.repo_id (ORG/NAME)")
    if cfg.hub.repo_id is not None and cfg.hub.repo_id.count("/") != 1:
        raise ConfigError(f"hub.repo_id: {cfg.hub.repo_id}: expected ORG/NAME")
    if cfg.data.text_pair_field == cfg.data.text_field:
        raise ConfigError("data.text_pair_field: must differ from data.text_field")
    if cfg.wandb.mode == "online" and not (os.environ.get("WANDB_API_KEY") or _has_netrc_login()):
        raise ConfigError("wandb.mode: online needs WANDB_API_KEY (or `wandb login`); use offline otherwise")
    for key in local_paths:
        value = OmegaConf.select(cfg, key)
        if _looks_local(value) and not Path(value).exists():
            raise ConfigError(f"{key}: {value}: no such file or folder")
    if cfg.model.revision is not None and _looks_local(cfg.model.name):
        raise ConfigError(f"model.revision: {cfg.model.revision} names a revision on the Hub, but model.name "
                          f"{cfg.model.name} is a local folder")


def _check_labels(cfg: DictConfig) -> None:
    """What the label keys ask of each other; what they ask of the data is checked on it
    (trainer/data/labels.py)."""
    data_cfg, train = cfg.data, cfg.train
    names, num_labels, weights = data_cfg.label_names, data_cfg.num_labels, train.class_weights
    if names is not None and len(set(names)) != len(names):
        raise ConfigError(f"data.label_names: the names must be distinct, got {list(names)}")
    if names is not None and num_labels is not None and len(names) != num_labels:
        raise ConfigError(f"data.label_names: expected {num_labels} names (data.num_labels), got {list(names)}")
    if isinstance(weights, Sequence) and not isinstance(weights, str) and num_labels is not None \
            and len(weights) != num_labels:
        raise ConfigError(f"train.class_weights: expected {num_labels} weights (data.num_labels), got {len(weights)}")


def _looks_local(value: str) -> bool:
    """Hub ids look like `org/name`; anything path-like is taken as local and must exist."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).suffix in {
        ".json", ".jsonl", ".csv", ".parquet"
    } or Path(value).exists()


def _has_netrc_login() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
