"""trainer/files.py: what a run writes is whole or absent, and flushed before it is renamed."""

from __future__ import annotations

import os

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

    files.publish(tmp, final)

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
