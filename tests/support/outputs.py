"""A run's outputs as tests read them: summary.json, metrics.jsonl, the model card, the complete checkpoints."""

from __future__ import annotations

import json
from pathlib import Path


def read_summary(output_dir: Path) -> dict:
    """The run's summary.json: what rank 0 writes once the run has ended."""
    return json.loads((Path(output_dir) / "summary.json").read_text())


def read_metrics(output_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one record per line, in the order written."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def model_card(folder: Path):
    """huggingface_hub's reading of the model card in `folder` (final/, final/adapter/)."""
    from huggingface_hub import ModelCard

    return ModelCard.load(Path(folder) / "README.md")


def complete_steps(output_dir: Path) -> list[int]:
    """Steps of the checkpoints with a completion marker, oldest first."""
    return sorted(int(p.parent.name[5:]) for p in (output_dir / "checkpoints").glob("step-*/COMPLETE"))
