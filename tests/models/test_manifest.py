"""Checksums of built folders: a damaged tiny model is rebuilt, never used."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from layerstream.models import ensure_tiny_model, load_pipeline
from layerstream.models.manifest import MANIFEST_NAME, CorruptFolderError, verify_manifest, write_manifest

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


def test_manifest_records_every_file_and_finds_each_kind_of_damage(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00" * 100)
    (tmp_path / "b.json").write_text("{}")
    write_manifest(tmp_path)
    verify_manifest(tmp_path)
    (tmp_path / "extra.txt").write_text("added later")  # not built by layerstream: not checked
    verify_manifest(tmp_path)

    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00" * 99 + b"\x01")  # same size, one bit differs
    (tmp_path / "b.json").unlink()
    with pytest.raises(CorruptFolderError) as error:
        verify_manifest(tmp_path)
    assert error.value.problems == ["b.json is missing", "sub/a.bin does not match the checksum recorded when it was built"]

    (tmp_path / MANIFEST_NAME).write_text("[")
    with pytest.raises(CorruptFolderError, match=f"{MANIFEST_NAME} is unreadable"):
        verify_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(CorruptFolderError, match="built before checksums were recorded"):
        verify_manifest(tmp_path)


def _poison_with_nan(file: Path) -> None:
    """What a disk error or a stray write can do: a valid safetensors file whose weights are garbage."""
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, file)


def _first_image(name: str) -> np.ndarray:
    pipe = load_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a fox", num_inference_steps=1, height=32, width=32, output_type="np",
               generator=torch.Generator().manual_seed(0))
    return np.asarray(out.images)


@pytest.mark.parametrize("damage", ["nan", "bit flip", "deleted", "no manifest"])
def test_damaged_tiny_model_is_rebuilt_on_load(monkeypatch, tmp_path, caplog, damage):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path))
    folder = ensure_tiny_model("tiny-flux")
    original = (folder / WEIGHTS).read_bytes()
    expected = _first_image("tiny-flux") if damage == "nan" else None
    if damage == "nan":
        _poison_with_nan(folder / WEIGHTS)
    elif damage == "bit flip":
        data = bytearray(original)
        data[-3] ^= 0x40
        (folder / WEIGHTS).write_bytes(bytes(data))
    elif damage == "deleted":
        (folder / WEIGHTS).unlink()
    else:
        (folder / MANIFEST_NAME).unlink()  # a cache built before checksums existed
    with caplog.at_level(logging.WARNING, logger="layerstream.models.tiny"):
        assert ensure_tiny_model("tiny-flux") == folder
    assert (folder / WEIGHTS).read_bytes() == original  # the weights are fixed-seed: the rebuild is identical
    warnings = [r.getMessage() for r in caplog.records if "failed its check" in r.getMessage()]
    assert len(warnings) == 1 and "rebuilding" in warnings[0]
    verify_manifest(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no scratch folders left
    if expected is not None:
        image = _first_image("tiny-flux")
        assert not np.isnan(image).any() and np.array_equal(image, expected)


def test_intact_tiny_model_is_not_rebuilt(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path))
    folder = ensure_tiny_model("tiny-flux")
    before = (folder / WEIGHTS).stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="layerstream.models.tiny"):
        ensure_tiny_model("tiny-flux")
    assert (folder / WEIGHTS).stat().st_mtime_ns == before and not caplog.records
