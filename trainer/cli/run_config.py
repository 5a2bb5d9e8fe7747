"""The config a command runs with: the schema's checks as it loads (trainer/config/), then what
the task and the strategy it names ask of it, which are theirs to say (trainer/tasks/registry.py,
trainer/strategies/registry.py). Torch-free: a mistake is one line before torch is imported."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.config import loading
from trainer.config.checks import LOCAL_PATHS
from trainer.config.schema import Config, typed
from trainer.strategies import registry as strategies
from trainer.tasks import registry as tasks


def load(path: str | None, overrides: Sequence[str] = (), local_paths: Sequence[str] = LOCAL_PATHS) -> Config:
    """Schema defaults, then the YAML file, then the overrides; resolved and checked: by the
    schema, then by the task and the strategy. Typed as the schema's `Config` from here on, so
    mypy checks every key the code reads (`schema.typed`)."""
    cfg = typed(loading.load(path, overrides, local_paths))
    tasks.check(cfg)
    strategies.check(cfg)
    return cfg
