"""trainer/files.py: what a run writes is whole or absent, and flushed before it is renamed."""

from __future__ import annotations

import os

import pytest

from trainer import files


def test_a_folder_is_published_whole_replacing_the_old_one_with_every_file_flushed(tmp_path, monkeypatch):
    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                real_fsync(fd)))
    final = tmp_path / "final"
    (final / "old").mkdir(parents=True)
    (final / "old" / "weights").write_text("old")
    tmp = files.fresh_folder(tmp_path / ".final.tmp")
    (tmp / "sub").mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / "sub" / "weights").write_text("new")

    files.rename_into_place(tmp, final)

    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == ["config.json", "sub", "sub/weights"]
    assert not tmp.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # nothing aside left
    # Each file was flushed under its temporary name before the rename, and the rename after it.
    assert flushed == [str(tmp / "config.json"), str(tmp / "sub" / "weights"), str(tmp_path)]


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    files.write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_picture_is_replaced_whole_or_kept_when_its_write_fails_midway(tmp_path, monkeypatch):
    """curves.png and goodput.png: a disk that fills halfway through matplotlib's write leaves
    the previous picture, not a torn one (nor a temporary file); a write that succeeds
    replaces it whole."""
    import matplotlib.figure

    from trainer.outputs import curves, report

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n'
                                            '{"step": 2, "loss": 1.5, "lr": 0.1}\n')
    kind = next(iter(report.COLORS))
    monkeypatch.setattr(report, "_goodput", lambda run_dir, ending: (
        {"attempts": [{"launched": 0.0, "ended": 10.0, "exit": 0, "ended_how": "done"}], "goodput": 0.5},
        [[(kind, 0.0, 10.0)]]))
    drawers = {"curves.png": lambda: curves.draw(tmp_path),
               "goodput.png": lambda: report.draw(tmp_path, tmp_path / "goodput.png")}
    real_savefig = matplotlib.figure.Figure.savefig

    def disk_full_midway(fig, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n-half-a-picture")
        raise OSError(28, "No space left on device")

    for name, draw in drawers.items():
        picture = tmp_path / name
        picture.write_bytes(b"the previous picture")
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full_midway)
        with pytest.raises(OSError, match="No space left"):
            draw()
        assert picture.read_bytes() == b"the previous picture", name
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real_savefig)
        draw()
        written = picture.read_bytes()
        assert written.startswith(b"\x89PNG\r\n\x1a\n") and written.endswith(b"IEND\xaeB`\x82"), name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["curves.png", "goodput.png", "metrics.jsonl"]
