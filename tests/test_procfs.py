"""The /proc figures, read from a stand-in /proc: MemAvailable and VmHWM in bytes, None where missing."""

from __future__ import annotations

import pytest

from layerstream.procfs import mem_available_nbytes, peak_rss_nbytes

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_figures_are_read_in_bytes_and_none_where_missing(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_text("MemTotal:       64000 kB\nMemAvailable:   32000 kB\n")
    (tmp_path / "self" / "status").write_text("Name:\tpython\nVmHWM:\t    2048 kB\nThreads:\t4\n")
    assert mem_available_nbytes(tmp_path) == 32000 * 1024
    assert peak_rss_nbytes(tmp_path) == 2048 * 1024
    (tmp_path / "meminfo").write_text("MemTotal:       64000 kB\n")  # a kernel before 3.14
    assert mem_available_nbytes(tmp_path) is None
    assert peak_rss_nbytes(tmp_path / "nowhere") is None
