"""A run's outputs as tests read them: summary.json, metrics.jsonl, the model card, the complete checkpoints,
the pictures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


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


def assert_picture(path: Path, min_size: tuple[int, int] = (300, 100)) -> np.ndarray:
    """`path` is a PNG that shows something: whole (PIL verifies it), at least `min_size` pixels
    (width, height), and not blank: a chart's antialiased lines and text make many colours, and
    its background, the commonest, leaves room for them. Returns its pixels (RGB, height x
    width x 3) for a test to look for what is plotted. A blank picture of any size, one colour
    or a few, fails."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # a torn or truncated file fails here
    with Image.open(path) as image:
        assert image.format == "PNG", (path, image.format)
        width, height = image.size
        assert width >= min_size[0] and height >= min_size[1], f"{path}: {image.size}, smaller than {min_size}"
        pixels = np.asarray(image.convert("RGB"))
    colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    assert len(colours) >= 16, f"{path}: blank, {len(colours)} colours"
    background = counts.max() / (width * height)
    assert background <= 0.99, f"{path}: blank, one colour covers {background:.1%}"
    return pixels


def chromatic(pixels: np.ndarray) -> np.ndarray:
    """Where `pixels` (assert_picture's) are coloured, not white, grey or black: a chart's axes
    and text are grey, its plotted marks in colour."""
    channels = pixels.astype(int)
    return channels.max(axis=-1) - channels.min(axis=-1) > 40


def goodput_bars(pixels: np.ndarray) -> list[int]:
    """What goodput.png (trainer/outputs/report.py `draw`) shows, from its pixels (assert_picture's): the
    length in pixels of each attempt's bar, top (attempt 1) to bottom, then its legend's, lowest. A
    bar is a band of rows filled with the categories' colours; each colour is solid, so a row's pixels
    of exactly those colours are its length (less a pixel at each boundary between colours, blended)."""
    from trainer.outputs.report import COLORS

    coloured = np.zeros(pixels.shape[:2], dtype=bool)
    for colour in COLORS.values():
        coloured |= (pixels == [int(colour[i:i + 2], 16) for i in (1, 3, 5)]).all(axis=-1)
    rows = np.flatnonzero(coloured.sum(axis=1) >= 10)  # not text, whose antialiasing hits a colour in a pixel or two
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1) if len(rows) else []
    return [int(coloured[band].sum()) // len(band) for band in bands]
