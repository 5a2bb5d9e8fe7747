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


def frame(pixels: np.ndarray) -> tuple[int, int, int, int]:
    """Where a one-axes chart's frame is in `pixels` (assert_picture's): the columns of its left
    and right spines and the rows of its top and bottom ones (left, top, right, bottom), the
    dark lines across most of the picture: axis text and ticks are shorter."""
    dark = pixels.max(axis=-1) < 128
    rows, columns = np.flatnonzero(dark.mean(axis=1) >= 0.5), np.flatnonzero(dark.mean(axis=0) >= 0.5)
    assert len(rows) >= 2 and len(columns) >= 2, f"no chart frame: dark rows {rows}, columns {columns}"
    return int(columns[0]), int(rows[0]), int(columns[-1]), int(rows[-1])


def rgb(colour: str) -> np.ndarray:
    """A matplotlib colour (a name, "#rrggbb", "C0") as the RGB bytes a picture shows it in."""
    from matplotlib.colors import to_rgb

    return np.round(np.array(to_rgb(colour)) * 255).astype(int)


def bar_heights(pixels: np.ndarray, colour: str) -> list[int]:
    """The bars of one solid `colour` that rise from the frame's bottom (a bar chart whose y axis
    starts at 0, its frame `frame`'s), left to right: each its height in pixels, the rows of
    exactly that colour (its top row, blended, and the spine under it not counted). A legend's
    patch of the colour does not touch the frame's bottom: not a bar."""
    left, top, right, bottom = frame(pixels)
    inside = (pixels[top + 1:bottom, left + 1:right].astype(int) == rgb(colour)).all(axis=-1)[::-1]  # bottom up
    heights = []
    for column in inside.T:
        start = np.flatnonzero(column[:3])  # a row or two over the spine may be blended with it
        height = 0
        if len(start):
            rest = column[start[0]:]
            height = int(np.argmin(rest)) if not rest.all() else len(rest)
        heights.append(height)
    bars, current = [], 0
    for height in [*heights, 0]:  # a bar: adjacent columns of the colour, as tall as its tallest
        if height:
            current = max(current, height)
        elif current:
            bars.append(current)
            current = 0
    return bars


def confusion_shown(pixels: np.ndarray, confusion: list[list[int]], cmap: str = "Blues") -> dict[int, int]:
    """What a confusion matrix drawn with imshow (trainer/tasks/single_label.py `plot`) shows of
    `confusion` (the counts its report gives, eval-SPLIT.json): for each count in it, how many
    pixels have the colour `cmap` gives that count between the smallest and the largest. A
    cell of the matrix is a block of tens of pixels square in its count's colour (less its
    text); the colour bar beside it has a row or two of each colour."""
    import matplotlib
    from matplotlib.colors import Normalize

    counts = np.array(confusion)
    norm, colours = Normalize(counts.min(), counts.max()), matplotlib.colormaps[cmap]
    shown = {}
    for count in np.unique(counts).tolist():
        colour = np.array(colours(norm(count), bytes=True)[:3], dtype=int)
        shown[count] = int((np.abs(pixels.astype(int) - colour).max(axis=-1) <= 2).sum())
    return shown


def scatter_box(pixels: np.ndarray) -> tuple[int, int, int, int]:
    """Where a one-axes chart's coloured marks lie inside its frame (`frame`), as (left, top,
    right, bottom) pixels: a scatter's points, in colour, the axes, text and a grey line not."""
    left, top, right, bottom = frame(pixels)
    rows, columns = np.nonzero(chromatic(pixels[top + 1:bottom, left + 1:right]))
    assert len(rows), "nothing plotted in colour inside the frame"
    return (left + 1 + int(columns.min()), top + 1 + int(rows.min()), left + 1 + int(columns.max()),
            top + 1 + int(rows.max()))


def assert_confusion_shown(pixels: np.ndarray, confusion: list[list[int]]) -> None:
    """The confusion matrix drawn in `pixels` shows `confusion`: each count as its cells' colour
    (`confusion_shown`), over at least 1,000 pixels a cell (a cell is 60 or more square)."""
    from collections import Counter

    cells = Counter(count for row in confusion for count in row)
    shown = confusion_shown(pixels, confusion)
    assert all(shown[count] >= 1000 * n for count, n in cells.items()), (shown, cells)
