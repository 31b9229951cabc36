"""Exact upcasts from float8 (each value is exactly a bfloat16 or float16 one, so a table made by torch's own
conversion gives `copy_`'s bits): torch's CPU kernel takes about 4 ns an element on a 2-core EPYC (three times a
1/64-scale Wan block's compute), a 256 KiB table indexed by two float8 bytes about 0.4; on an accelerator `copy_`.
"""

from __future__ import annotations

import sys
import threading

import torch

FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

_CHUNK_PAIRS = 1 << 18  # per lookup: a 1 MiB index buffer per thread (2^16 to 2^19 pairs measured alike)

MIN_LOOKUP_ELEMENTS = 4096  # below this, `copy_` is quicker than planning lookups (microseconds of Python)

_tables: dict[tuple[torch.dtype, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
_tables_lock = threading.Lock()
_scratch = threading.local()


class Upcast:
    """`destination.copy_(stored)` planned once for a slot's views: table lookups for float8 on the CPU."""

    __slots__ = ("destination", "stored", "_steps", "_index_numel")

    def __init__(self, destination: torch.Tensor, stored: torch.Tensor):
        self.destination, self.stored = destination, stored
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._index_numel = 0
        if _takes_lookup(destination, stored):
            self._steps = _plan_steps(destination, stored)
            self._index_numel = max(source.numel() for _, source, _ in self._steps)

    def run_(self) -> torch.Tensor:
        if self._steps is None:
            return self.destination.copy_(self.stored)
        index = _index_buffer(self._index_numel)
        for table, source, out in self._steps:
            used = index[: source.numel()]
            used.copy_(source)  # zero-extended: a byte (or a pair of bytes as one unsigned 16-bit number)
            torch.index_select(table, 0, used, out=out)
        return self.destination


def upcast_(destination: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """`destination.copy_(stored)` for a float8 `stored`, bit for bit (a one-off `Upcast`)."""
    return Upcast(destination, stored).run_()


def _plan_steps(destination: torch.Tensor, stored: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(table, indices, out) chunks: pairs where both tensors align, single bytes for an unaligned head or tail."""
    single, pairs = _tables_for(stored.dtype, destination.dtype)
    codes, out = stored.view(torch.uint8).reshape(-1), destination.view(torch.int16).reshape(-1)
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    start = out.storage_offset() % 2  # the pairs start on a 4-byte boundary of the destination
    body = (codes.numel() - start) // 2 * 2
    if body and codes.storage_offset() % 2 != start % 2:
        start, body = 0, 0  # the two tensors' offsets differ in parity: no pair reads both aligned
    if start:
        steps += _chunks(single, codes[:start], out[:start])
    if body:
        packed = codes[start : start + body].view(torch.uint16)
        steps += _chunks(pairs, packed, out[start : start + body].view(torch.int32))
    if start + body < codes.numel():
        steps += _chunks(single, codes[start + body :], out[start + body :])
    return steps


def _chunks(table: torch.Tensor, source: torch.Tensor, out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [
        (table, source[first : first + _CHUNK_PAIRS], out[first : first + _CHUNK_PAIRS])
        for first in range(0, source.numel(), _CHUNK_PAIRS)
    ]


def _takes_lookup(destination: torch.Tensor, stored: torch.Tensor) -> bool:
    return (
        sys.byteorder == "little"  # the table of pairs reads two neighbouring bytes as one number
        and stored.dtype in FLOAT8_DTYPES
        and destination.dtype in (torch.bfloat16, torch.float16)
        and destination.device.type == "cpu"
        and stored.device.type == "cpu"
        and destination.shape == stored.shape
        and destination.is_contiguous()
        and stored.is_contiguous()
        and not destination.requires_grad
        and stored.numel() >= MIN_LOOKUP_ELEMENTS
    )


def _tables_for(source: torch.dtype, target: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The 256-entry table (int16) and the 65,536-entry table of pairs (int32, the low byte's in the low half)."""
    key = (source, target)
    tables = _tables.get(key)
    if tables is not None:
        return tables
    with _tables_lock, torch.inference_mode(False), torch.no_grad():
        if key not in _tables:
            single = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(source).to(target).view(torch.int16)
            index = torch.arange(1 << 16, dtype=torch.int32)
            low = single[index & 0xFF].to(torch.int32) & 0xFFFF
            high = single[index >> 8].to(torch.int32) << 16
            _tables[key] = (single.contiguous(), (low | high).contiguous())
    return _tables[key]


def _index_buffer(count: int) -> torch.Tensor:
    """This thread's int32 index buffer, at least `count` long (the copy thread, a read thread, compute)."""
    buffer = getattr(_scratch, "index", None)
    if buffer is None or buffer.numel() < count:
        with torch.inference_mode(False):
            buffer = _scratch.index = torch.empty(max(count, 1), dtype=torch.int32)
    return buffer[:count]
