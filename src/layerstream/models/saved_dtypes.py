"""The dtype each component of a diffusers-format folder was saved in, read from its safetensors headers alone.
diffusers loads in float32 unless told otherwise (a bfloat16 checkpoint at twice its size); loading each
component as stored also keeps its weights lazy views of the files, which the host store reads blocks from.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from layerstream.errors import LayerstreamError
from layerstream.models.folder_check import pipeline_components

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
"""Floating dtypes a component can compute in (float8 is a storage format), as safetensors names them."""

_MAX_HEADER_BYTES = 100 * 2**20


class SafetensorsHeaderError(LayerstreamError, ValueError):
    """A safetensors file whose header cannot be read (truncated or not safetensors)."""


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}, plus metadata."""
    with open(path, "rb") as f:
        return parse_safetensors_header(file_reader(f), str(path))[0]


def parse_safetensors_header(read_at: Callable[[int, int], bytes], where: str) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, the offset its data starts at), read by `read_at(offset, count)`
    (a local file's, or a Hub file's ranged read); `where` names the file in errors."""
    raw = read_at(0, 8)
    if len(raw) != 8:
        raise SafetensorsHeaderError(f"{where}: too short to be a safetensors file ({len(raw)} bytes)")
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"{where}: header length {length} is not plausible; the file is not safetensors")
    text = read_at(8, length)
    if len(text) != length:
        raise SafetensorsHeaderError(f"{where}: truncated header ({len(text)} of {length} bytes)")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise SafetensorsHeaderError(f"{where}: the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{where}: the header is not a JSON object")
    return header, 8 + length


def file_reader(f: BinaryIO) -> Callable[[int, int], bytes]:
    """`read_at(offset, count)` over an open binary file: at most `count` bytes from `offset`."""

    def read_at(offset: int, count: int) -> bytes:
        f.seek(offset)
        return f.read(count)

    return read_at


def loaded_safetensors(folder: Path, variant: str | None = None) -> list[Path]:
    """The component folder's safetensors files diffusers loads: of `variant` where it has them."""
    from layerstream.models.weight_files import weight_file_key

    files = sorted(folder.glob("*.safetensors"))
    mine = [p for p in files if weight_file_key(p.name) == (".safetensors", variant)] if variant else []
    return mine or [p for p in files if weight_file_key(p.name) == (".safetensors", None)]


def stored_dtype(folder: Path, variant: str | None = None) -> torch.dtype | None:
    """The floating dtype holding most bytes in the component folder's files (None: none)."""
    totals: dict[torch.dtype, int] = {}
    for path in loaded_safetensors(folder, variant):
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
            offsets = entry.get("data_offsets") or (0, 0)
            if dtype is not None:
                totals[dtype] = totals.get(dtype, 0) + int(offsets[1]) - int(offsets[0])
    return max(totals, key=totals.get) if totals else None


def saved_dtypes(folder: Path, variant: str | None = None) -> dict[str, torch.dtype]:
    """Component name -> the dtype its safetensors files store (others left to their library)."""
    out = {}
    for name in pipeline_components(folder):
        if not (folder / name).is_dir():
            continue
        try:
            dtype = stored_dtype(folder / name, variant)
        except (OSError, SafetensorsHeaderError):
            continue  # diffusers reports an unreadable file when it loads it, naming it
        if dtype is not None:
            out[name] = dtype
    return out


def module_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The floating dtype holding most of a module's parameter and buffer bytes."""
    totals: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen or not t.is_floating_point():
            continue
        seen.add(id(t))
        totals[t.dtype] = totals.get(t.dtype, 0) + t.element_size() * t.numel()
    return max(totals, key=totals.get) if totals else None
