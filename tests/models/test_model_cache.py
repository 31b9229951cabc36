"""The cache location and atomic publishing of built folders."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerstream.models.cache import STALE_BUILD_SECONDS, CacheFolderError, cache_root, discard_folder, publish_folder
from layerstream.processes import process_space, process_start_ticks


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LAYERSTREAM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "layerstream"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "layerstream"

    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def _writer(calls: list[Path], content: str = "ok"):
    def write(build: Path) -> None:
        calls.append(build)
        (build / "sub").mkdir()
        (build / "sub" / "weights.bin").write_text(content)
        (build / "index.json").write_text("{}")

    return write


def test_publish_builds_once_and_leaves_no_build_folder(tmp_path):
    folder = tmp_path / "models" / "m-v1"
    calls: list[Path] = []
    assert publish_folder(folder, _writer(calls), marker="index.json") is True
    assert publish_folder(folder, _writer(calls), marker="index.json") is False
    assert len(calls) == 1 and calls[0].parent == folder.parent and calls[0] != folder
    assert (folder / "sub" / "weights.bin").read_text() == "ok"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m-v1"]


def test_failed_build_leaves_nothing(tmp_path):
    folder = tmp_path / "m-v1"

    def crash(build: Path) -> None:
        (build / "index.json").write_text("{}")
        (build / "half.bin").write_text("x")
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError, match="killed half-way"):
        publish_folder(folder, crash, marker="index.json")
    assert list(tmp_path.iterdir()) == []


def test_build_without_marker_is_rejected(tmp_path):
    with pytest.raises(CacheFolderError, match="no index.json"):
        publish_folder(tmp_path / "m-v1", lambda build: None, marker="index.json")
    assert list(tmp_path.iterdir()) == []


def test_losing_a_race_keeps_the_winners_folder(tmp_path):
    folder = tmp_path / "m-v1"

    def write_while_another_process_publishes(build: Path) -> None:
        _writer([], content="mine")(build)
        publish_folder(folder, _writer([], content="winner"), marker="index.json")

    assert publish_folder(folder, write_while_another_process_publishes, marker="index.json") is False
    assert (folder / "sub" / "weights.bin").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-v1"]


def test_foreign_folder_is_not_overwritten(tmp_path):
    folder = tmp_path / "m-v1"
    folder.mkdir()
    (folder / "notes.txt").write_text("someone else's")
    with pytest.raises(CacheFolderError, match="not a complete build"):
        publish_folder(folder, _writer([]), marker="index.json")
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def _scratch_name(folder: Path, space: str, pid: int, start: int | None) -> str:
    return f".{folder.name}.tmp-{space}-{pid}-{start or 0}-0123abcd"


def _dead_pid() -> int:
    """A pid no process has: a child that has been waited for."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait() == 0
    return child.pid


def test_build_folders_of_dead_processes_are_removed_at_the_next_build(tmp_path):
    folder = tmp_path / "m-v1"
    me, space = os.getpid(), process_space()
    foreign = "00000000" if space != "00000000" else "11111111"  # another machine or pid namespace
    dead = tmp_path / _scratch_name(folder, space, _dead_pid(), 123)  # crashed a moment ago: removed though recent
    live = tmp_path / _scratch_name(folder, space, me, process_start_ticks(me))  # a build running in this process: kept
    reused = tmp_path / _scratch_name(folder, space, me, (process_start_ticks(me) or 0) + 1)  # this pid, an ended process
    elsewhere = tmp_path / _scratch_name(folder, foreign, 1, 1)  # cannot tell: kept while recent
    old_elsewhere = tmp_path / _scratch_name(folder, foreign, 2, 1)  # cannot tell, but old: removed
    old_format = tmp_path / ".m-v1.tmp-2-busy"  # not a tag: kept while recent
    for leftover in (dead, live, reused, elsewhere, old_elsewhere, old_format):
        leftover.mkdir()
        (leftover / "half.bin").write_text("x")
    old = time.time() - 2 * STALE_BUILD_SECONDS
    os.utime(old_elsewhere, (old, old))
    publish_folder(folder, _writer([]), marker="index.json")
    kept = sorted(p.name for p in tmp_path.iterdir())
    if sys.platform.startswith("linux"):  # /proc tells a reused pid apart
        assert reused.name not in kept
    assert sorted(set(kept) - {reused.name}) == sorted([live.name, elsewhere.name, old_format.name, "m-v1"])


def test_discard_folder_removes_it_whole(tmp_path):
    folder = tmp_path / "m-v1"
    publish_folder(folder, _writer([]), marker="index.json")
    discard_folder(folder)
    discard_folder(folder)  # already gone (another process discarded it): not an error
    assert list(tmp_path.iterdir()) == []
    assert publish_folder(folder, _writer([], content="again"), marker="index.json") is True
    assert (folder / "sub" / "weights.bin").read_text() == "again"
