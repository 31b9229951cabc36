"""What a component file holds, read from its header alone: each tensor's name, logical shape, and the dtype and
shape its bytes are stored in (GGUF: quantized blocks as uint8 rows; safetensors: as the header says). A local
file is read by seeks, a Hub file (``hf://...``) by HTTP Range requests through huggingface_hub's session: a
plan reads a few hundred KiB of a multi-GB file, never the file."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerstream.models.folder_check import ModelLoadError
from layerstream.models.saved_dtypes import SAFETENSORS_DTYPES, file_reader, parse_safetensors_header
from layerstream.wording import first_line, format_bytes

ReadAt = Callable[[int, int], bytes]

_GGUF_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
"""GGUF tensor types stored unquantized (F32, F16, BF16), by their number."""
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
MAX_HEADER_BYTES = 64 << 20
"""A GGUF header longer than this is refused (a diffusion model's is a few hundred KiB)."""


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple[int, ...]
    """The logical shape (a GGUF tensor's dims reversed, as torch orders them)."""
    stored_shape: tuple[int, ...]
    stored_dtype: torch.dtype
    kind: str
    """The file's own name of its type: ``"Q4_K"``, ``"F8_E4M3"``, ``"BF16"``."""


def header_tensors(name: str, spec: str, source: Path | Any) -> dict[str, StoredTensor]:
    """The tensors of component `name`'s file (`spec` as given; `source` its path on this machine, or the
    `component_files.HubFile` read by ranges), by the file's names. One line naming the component if it cannot
    be read."""
    try:
        if isinstance(source, Path):
            with open(source, "rb") as f:
                return _tensors(file_reader(f), source.name, spec)
        return _tensors(_hub_reader(source), source.filename, spec)
    except ModelLoadError:
        raise
    except Exception as e:  # not a GGUF / safetensors file after all, a network or Hub error
        raise ModelLoadError(f"component {name} = {spec!r}: cannot read its header: {first_line(e, with_type=True)}") from e


def _tensors(read_at: ReadAt, filename: str, spec: str) -> dict[str, StoredTensor]:
    if filename.endswith(".gguf"):  # the file's own name: a local path may hold an "@" that is no revision
        return gguf_tensors(read_at)
    header, _ = parse_safetensors_header(read_at, spec)
    out = {}
    for key, entry in header.items():
        if key != "__metadata__" and isinstance(entry, dict):
            shape = tuple(entry["shape"])
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) or getattr(torch, _SAFETENSORS_OTHER.get(entry["dtype"], ""), torch.uint8)
            out[key] = StoredTensor(shape, shape, dtype, entry["dtype"])
    return out


_SAFETENSORS_OTHER = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "U8": "uint8"}


def gguf_tensors(read_at: ReadAt) -> dict[str, StoredTensor]:
    """The tensor infos of a GGUF file (version 2 or 3), read in growing chunks from its start."""
    import gguf

    stream = _Stream(read_at)
    magic, version, num_tensors, num_kv = struct.unpack("<4sIQQ", stream.take(24))
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
    for _ in range(num_kv):
        stream.string()
        stream.value(struct.unpack("<I", stream.take(4))[0])
    out = {}
    for _ in range(num_tensors):
        tensor_name = stream.string()
        (num_dims,) = struct.unpack("<I", stream.take(4))
        dims = struct.unpack(f"<{num_dims}Q", stream.take(8 * num_dims))
        kind, _offset = struct.unpack("<IQ", stream.take(12))
        shape = tuple(reversed(dims))
        if kind in _GGUF_PLAIN:
            out[tensor_name] = StoredTensor(shape, shape, _GGUF_PLAIN[kind], gguf.GGMLQuantizationType(kind).name)
            continue
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        stored = (*shape[:-1], shape[-1] // block * block_bytes)
        out[tensor_name] = StoredTensor(shape, stored, torch.uint8, gguf.GGMLQuantizationType(kind).name)
    return out


class _Stream:
    """Sequential reads over `read_at`, fetched in chunks that double (a header is a few KiB to a few MiB)."""

    def __init__(self, read_at: ReadAt, chunk: int = 1 << 18):
        self._read_at, self._chunk = read_at, chunk
        self._data, self._pos = b"", 0

    def take(self, count: int) -> bytes:
        if self._pos + count > MAX_HEADER_BYTES:  # a length no real header has: never read a whole file for it
            raise ValueError(f"the header would be longer than {format_bytes(MAX_HEADER_BYTES)}")
        while self._pos + count > len(self._data):
            more = self._read_at(len(self._data), self._chunk)
            if not more:
                raise ValueError("the file ends inside its header")
            self._data += more
            self._chunk *= 2
        out = self._data[self._pos : self._pos + count]
        self._pos += count
        return out

    def string(self) -> str:
        (length,) = struct.unpack("<Q", self.take(8))
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int) -> None:
        """Read past one metadata value of type `kind`."""
        if kind == _GGUF_STRING:
            self.string()
        elif kind == _GGUF_ARRAY:
            item, count = struct.unpack("<IQ", self.take(12))
            if item in _GGUF_SCALARS:
                self.take(count * struct.calcsize(_GGUF_SCALARS[item]))
            else:
                for _ in range(count):
                    self.value(item)
        else:
            self.take(struct.calcsize(_GGUF_SCALARS[kind]))


def _hub_reader(hub_file) -> ReadAt:
    """Byte ranges of a Hub file at its revision (huggingface_hub's URL, session and token)."""
    from layerstream.models.hub import HubSettings
    from layerstream.models.hub_sample import _RangedReader

    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    settings = HubSettings.from_environment()
    revision = hub_file.revision or "main"
    size = get_hf_file_metadata(hf_hub_url(hub_file.repo_id, hub_file.filename, revision=revision, endpoint=settings.endpoint)).size
    reader = _RangedReader(hub_file.repo_id, revision, settings.endpoint)
    return lambda offset, count: reader.read(hub_file.filename, offset, max(0, min(count, (size or 0) - offset)))
