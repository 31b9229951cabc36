"""`Readahead`: the largest component's files are read ahead first, up to the budget, and stop() ends it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from layerstream.models.readahead import CHUNK_BYTES, Readahead

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = [pytest.mark.fast, pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is not available here")]


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X"}))
    for name, size in (("vae", 1 << 20), ("transformer", 3 * CHUNK_BYTES // 2)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "a.safetensors", "wb") as f:
            f.truncate(size)  # sparse: nothing is really written
    return tmp_path


def test_the_largest_component_is_read_ahead_first_up_to_the_budget(tmp_path):
    folder = _folder(tmp_path)
    readahead = Readahead.for_pipeline_folder(folder)
    assert [p.parent.name for p in readahead._files] == ["transformer", "vae"]
    readahead.wait()
    assert readahead.bytes_requested == 3 * CHUNK_BYTES // 2 + (1 << 20)  # everything: well under the budget

    capped = Readahead(readahead._files, budget=CHUNK_BYTES)
    capped.wait()
    assert capped.bytes_requested == CHUNK_BYTES  # one chunk of the transformer, nothing of the VAE

    stopped = Readahead(readahead._files, budget=0)
    stopped.stop()
    assert stopped.bytes_requested == 0

    # stop() waits for the thread (stopped between two requests, or done): nothing is requested after it
    many = Readahead(readahead._files * 200, budget=1 << 40)
    many.stop()
    requested = many.bytes_requested
    assert many._thread is not None and not many._thread.is_alive()
    assert many.bytes_requested == requested


def test_a_component_loaded_from_a_file_of_its_own_is_not_read_ahead(tmp_path):
    readahead = Readahead.for_pipeline_folder(_folder(tmp_path), skip={"transformer": None})
    assert [p.parent.name for p in readahead._files] == ["vae"]
    readahead.stop()
