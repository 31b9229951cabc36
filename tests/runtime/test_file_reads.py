"""`MappedFiles` tells which file bytes back a lazily mapped weight, and refuses pages written since mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

safetensors_torch = pytest.importorskip("safetensors.torch")

from layerstream.runtime.packing.file_reads import FileReader, MappedFiles  # noqa: E402


def test_unwritten_views_map_to_the_file_and_written_ones_do_not(tmp_path: Path):
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"a": torch.randn(512, 512), "b": torch.randn(512, 512)}, str(path))
    weights = safetensors_torch.load_file(str(path))  # lazy views of a private mapping of the file
    a, b = weights["a"], weights["b"]
    b[-1, -1] = 0.0  # copy on write: b's last page is memory now (a's pages, a page-sized gap away, are not)
    files = MappedFiles.snapshot()
    try:
        source = files.file_range(a.data_ptr(), a.numel() * a.element_size())
        assert source is not None and Path(source.path) == path
        reader = FileReader()
        try:
            out = torch.empty(source.nbytes, dtype=torch.uint8)
            reader.read_into_(out, source)
        finally:
            reader.close()
        assert torch.equal(out.view(torch.float32).view(512, 512), a)
        assert files.file_range(b.data_ptr(), b.numel() * b.element_size()) is None
        assert files.file_range(torch.randn(10).data_ptr(), 40) is None  # ordinary memory
    finally:
        files.close()
