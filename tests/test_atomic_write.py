"""`write_atomically`: the target is the old file or the complete new one, never a part, and no temporary file
stays behind, whether the writer finishes, fails or is interrupted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerstream.atomic_write import PARTIAL_MARK, write_atomically

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_a_complete_write_replaces_the_target_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "fox.mp4"
    target.write_bytes(b"old")
    with write_atomically(target) as partial:
        assert partial.parent == tmp_path and partial.suffix == ".mp4"  # writers that read the suffix still can
        assert partial.name.startswith(".fox" + PARTIAL_MARK)
        assert target.read_bytes() == b"old"  # untouched until the writer is done
        _write(partial, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["fox.mp4"]


@pytest.mark.parametrize("error", [ValueError("encoder failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failed_write_keeps_the_old_file_and_removes_the_partial_one(tmp_path, error):
    target = tmp_path / "fox.gif"
    target.write_bytes(b"old")
    with pytest.raises(type(error)):
        with write_atomically(target) as partial:
            _write(partial, b"14 of 81 frames")
            raise error
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["fox.gif"]


def test_a_failed_first_write_leaves_no_file(tmp_path):
    with pytest.raises(ValueError):
        with write_atomically(tmp_path / "new" / "fox.png") as partial:
            _write(partial, b"half")
            raise ValueError
    assert list((tmp_path / "new").iterdir()) == []


def test_the_output_gets_the_mode_a_plain_write_would_give(tmp_path):
    plain = tmp_path / "plain.png"
    _write(plain, b"x")
    with write_atomically(tmp_path / "fox.png") as partial:
        _write(partial, b"x")
    assert (tmp_path / "fox.png").stat().st_mode == plain.stat().st_mode  # the umask's, not mkstemp's 0600


def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    with write_atomically(link) as partial:
        _write(partial, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_concurrent_writers_pick_different_temporary_names(tmp_path):
    target = tmp_path / "fox.png"
    with write_atomically(target) as first, write_atomically(target) as second:
        assert first != second
        _write(first, b"first")
        _write(second, b"second")
    assert target.read_bytes() == b"first"  # the outer one is renamed last
    assert os.listdir(tmp_path) == ["fox.png"]
