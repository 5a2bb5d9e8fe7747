"""A run's weights, from a checkpoint (whole or sharded) or a model folder, and their comparison."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EXACT_STEPS = 40
"""The length of the runs held to `single_process_weights`: across an epoch boundary (600
samples / global batch 16 = 37 steps per epoch)."""


def weights(source: Path, step: int | None = None) -> dict:
    """The weights of a run's checkpoint at `step` (source: the run's output_dir), or of a
    model folder (step None). A sharded checkpoint's (FSDP) are read whole."""
    from safetensors.torch import load_file

    folder = source if step is None else source / "checkpoints" / f"step-{step}"
    if (folder / "sharded").is_dir():
        return sharded_checkpoint(folder)["model"]
    return load_file(str(folder / "model.safetensors"))


def sharded_checkpoint(folder: Path) -> dict:
    """A sharded checkpoint's DCP state, whole: {"model": ..., "optimizer": {"state": ...}}."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder / "sharded", Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=False)  # written just now, by DCP


@dataclass(frozen=True)
class WeightDiff:
    differing: list[str]
    """Tensors that are not bitwise equal, or that only one side has: empty when identical."""
    max_abs: float
    """The largest elementwise difference over the tensors both sides have."""


def compare_weights(expected: dict | Path, actual: dict | Path, step: int | None = None) -> WeightDiff:
    """Two state dicts, or two runs' step-`step` checkpoints (or model folders) by path."""
    import torch

    expected = weights(expected, step) if isinstance(expected, Path) else expected
    actual = weights(actual, step) if isinstance(actual, Path) else actual
    common = sorted(expected.keys() & actual.keys())
    differing = [name for name in common if not torch.equal(expected[name], actual[name])]
    max_abs = max((float((expected[n].double() - actual[n].double()).abs().max()) for n in common), default=0.0)
    return WeightDiff(sorted(expected.keys() ^ actual.keys()) + differing, max_abs)
