"""toolkit.atomic: outputs appear whole or not at all, and nothing is left behind."""

from __future__ import annotations

import os
import stat

import pytest

from toolkit.atomic import building, building_once, write_text


def test_failed_build_keeps_the_old_output_and_leaves_nothing(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half-way"), building(dst) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in dst.iterdir()] == ["old.txt"]


def test_finished_build_replaces_the_output(tmp_path):
    dst = tmp_path / "a" / "out"  # parents are created
    for text in ("first", "second"):
        with building(dst) as tmp:
            assert not dst.exists() or (dst / "v.txt").read_text() == "first"
            (tmp / "v.txt").write_text(text)
    assert (dst / "v.txt").read_text() == "second"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["out"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o777 & ~mask  # not mkdtemp's 0700


def test_write_text_replaces_whole_file(tmp_path):
    path = tmp_path / "x" / "f.json"
    write_text(path, "1")
    write_text(path, "22")
    assert path.read_text() == "22"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_concurrent_builders_of_one_cache_entry_keep_the_first_copy(tmp_path):
    """The local rank 0 of two nodes tokenise the same data into one shared cache: both finish,
    the second neither fails (a rename onto a non-empty folder does) nor moves the first copy
    away under a reader of it."""
    dst = tmp_path / "tokenized" / "key"
    first, second = building_once(dst), building_once(dst)
    a, b = first.__enter__(), second.__enter__()  # both started before either finished
    (a / "data.idx").write_text("same")
    (b / "data.idx").write_text("same")
    first.__exit__(None, None, None)
    inode = (dst / "data.idx").stat().st_ino
    with open(dst / "data.idx") as reader:  # a reader of the first copy
        second.__exit__(None, None, None)
        assert reader.read() == "same"
    assert (dst / "data.idx").stat().st_ino == inode  # still the first copy, in place
    assert sorted(p.name for p in dst.parent.iterdir()) == ["key"]  # the second's copy removed
    with pytest.raises(RuntimeError), building_once(tmp_path / "other") as tmp:
        (tmp / "x").write_text("half")
        raise RuntimeError("half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenized"]
