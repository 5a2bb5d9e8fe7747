"""output_dir/curves.png: the run's loss, learning rate, throughput and validation metrics by
step, drawn from metrics.jsonl (`tracking.curves`, and `python -m trainer plot RUN_DIR`).

metrics.jsonl forgets the lines of the steps a resume redoes, so a run that was killed and
resumed draws one continuous line; each restart (attempts.jsonl: the checkpoint each attempt
resumed from) is a dashed line at the step it went on from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer import files
from trainer.errors import ConfigError
from trainer.faults import attempts

FILE = "curves.png"


@dataclass
class Series:
    """What the picture draws: each key's (steps, values), and the restarts' steps."""

    train: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """loss, lr, samples_per_s: one point per logging step."""
    validation: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Each eval/ metric, one point per evaluation."""
    restarts: list[int] = field(default_factory=list)


def series(run_dir: Path) -> Series:
    """metrics.jsonl and attempts.jsonl of the run in `run_dir`, as the picture's lines."""
    records = files.read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        raise ConfigError(f"plot: {run_dir}: no metrics.jsonl: not the output_dir of a run that logged")
    drawn = Series(restarts=[a["resumed_from"] for a in attempts.read(run_dir)[1:]])

    def add(lines: dict, key: str, step: int, value) -> None:
        steps, values = lines.setdefault(key, ([], []))
        steps.append(step)
        values.append(value)

    for record in records:
        for key in ("loss", "lr", "samples_per_s"):
            if isinstance(record.get(key), int | float):
                add(drawn.train, key, record["step"], record[key])
        for key, value in record.items():
            if key.startswith("eval/") and isinstance(value, int | float):
                add(drawn.validation, key.removeprefix("eval/"), record["step"], value)
    return drawn


def draw(run_dir: Path, path: Path | None = None) -> Path:
    """The picture of `run_dir`'s curves, to `path` (default run_dir/curves.png)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    drawn = series(run_dir)
    panels = [("training loss (validation: points)", ["loss"]), ("learning rate", ["lr"]),
              ("samples/s", ["samples_per_s"]), ("validation", sorted(drawn.validation.keys() - {"loss"}))]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        lines = drawn.validation if title == "validation" else drawn.train
        for key in keys:
            if key in lines:
                ax.plot(*lines[key], marker="o" if title == "validation" else None, markersize=3, label=key)
        if title.startswith("training loss") and "loss" in drawn.validation:
            ax.plot(*drawn.validation["loss"], "o", markersize=4, label="validation loss")
        for restart in drawn.restarts:
            ax.axvline(restart, color="grey", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        if len(keys) > 1 or ax.get_legend_handles_labels()[0][1:]:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step" + (f" (dashed: restarts, resumed from {', '.join(map(str, drawn.restarts))})"
                                if drawn.restarts else ""))
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = path or run_dir / FILE
    files.write_figure(fig, path, dpi=90)
    plt.close(fig)
    return path
