"""fp8_scaled safetensors single files: float8 weights, each with a per-tensor scale beside it."""

from __future__ import annotations

from pathlib import Path

from layerstream.models.saved_dtypes import read_safetensors_header

FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")


def is_float8_file(path: Path) -> bool:
    """Whether the safetensors file at `path` holds a float8 tensor (read from its header alone)."""
    header = read_safetensors_header(path)
    return any(isinstance(e, dict) and e.get("dtype") in FLOAT8_DTYPES for e in header.values())


def load_fp8_scaled(name, cls, path, options):
    raise NotImplementedError
