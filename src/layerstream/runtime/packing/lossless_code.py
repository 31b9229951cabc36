"""A lossless code for 16-bit floating-point tensors (bfloat16, float16): about 0.7x the bytes, bit for bit.

Each 16-bit element is split into a raw byte, kept as it is (bfloat16: the sign and the seven mantissa bits;
float16: the low byte), and a coded byte (bfloat16: the exponent; float16: the high byte), whose values are few
in a weight tensor (a normal weight's exponents carry about 2.6 bits). The coded bytes become fixed-width codes of
`width` bits indexing a table of the 2^width - 1 most frequent values; the last code is an escape, whose element's
high part is listed beside its position in an escape list. A `SpanCode` is the plan of one tensor's code (its
sizes are fixed when it is made, so every offset is known without reading the bytes); its stored bytes are:

    raw bytes (n) | code fields (4-, 2- and 1-bit fields, each packed in its own bytes) | table (int16) |
    escape positions (int32, `capacity`) | escape values (int16, `capacity`)

Decoding is a few whole-tensor torch ops per chunk (shifts, one gather in a table of at most 128 entries) and one
gather and scatter of the escapes, on any device, with no custom kernel and no host sync. The escape list has
`capacity` entries, a little more than the tensor needs when it is coded (so a re-encode after LoRA fusing or a
load usually fits); unused entries repeat the first element with its own value, which writes nothing new.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

CodedDtype = Literal["bfloat16", "float16"]
CODED_DTYPES: dict[torch.dtype, CodedDtype] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

_SHIFT = {"bfloat16": 7, "float16": 8}
"""Where the coded byte sits in the 16-bit element."""
_HIGH_MASK = {"bfloat16": 0x7F80, "float16": 0xFF00}
"""The coded byte's bits in place (the element's "high part")."""
_RAW_MASK16 = {"bfloat16": -32641, "float16": 0x00FF}  # 0x807F as int16: the sign and the mantissa bits
_FIELDS: dict[int, tuple[int, ...]] = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1)}
"""A code width as fields of 4, 2 and 1 bits (each unpacks with one shift and one mask per byte)."""
_ALIGN = 16
_ESCAPE_BYTES = 6  # an int32 position and an int16 value

DECODE_CHUNK_ELEMENTS = {"cpu": 1 << 18, "other": 1 << 22}
"""Elements decoded per step: on the CPU the step's scratch (9 bytes an element) stays in the core's cache
(2^16 to 2^18 measured alike here, 2^20 a third slower); on an accelerator a step's scratch stays small beside the
slot ring."""

ESTIMATED_CODED_FRACTION = 0.69
"""Stored bytes per 16-bit byte assumed where the values are not there to code (a skeleton on the meta device,
`layerstream plan`): the ratio measured on normal weights with trained-like spreads (`benchmarks/lossless.py`)."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def escape_capacity(num_escapes: int, num_elements: int) -> int:
    """Escape entries kept for a tensor that needs `num_escapes`: a little more, so that small changes (a fused
    LoRA) still fit when it is coded again."""
    return num_escapes + max(16, num_elements // 1024)


@dataclass(frozen=True)
class SpanCode:
    """The code of one tensor of `num_elements` 16-bit elements (see the module docstring)."""

    dtype: CodedDtype
    num_elements: int
    width: int
    """Bits per code, 1 to 7: 2^width - 1 table values and the escape."""
    capacity: int
    """Escape entries kept."""

    @property
    def fields(self) -> tuple[tuple[int, int, int], ...]:
        """(field width, shift within the code, byte offset) of each code field."""
        out, shift, at = [], 0, _align(self.num_elements)
        for w in _FIELDS[self.width]:
            out.append((w, shift, at))
            shift += w
            at += _align(-(-self.num_elements * w // 8))
        return tuple(out)

    @property
    def table_offset(self) -> int:
        w, _, at = self.fields[-1]
        return at + _align(-(-self.num_elements * w // 8))

    @property
    def escape_offset(self) -> int:
        return self.table_offset + _align(2 << self.width)

    @property
    def escape_values_offset(self) -> int:
        return self.escape_offset + _align(4 * self.capacity)

    @property
    def nbytes(self) -> int:
        return self.escape_values_offset + _align(2 * self.capacity)

    @property
    def escape_code(self) -> int:
        return (1 << self.width) - 1


def split(x16: torch.Tensor, dtype: CodedDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(coded bytes, raw bytes) of 16-bit elements (`x16`: int16, flat)."""
    x = x16.to(torch.int32)
    coded = ((x >> _SHIFT[dtype]) & 0xFF).to(torch.uint8)
    if dtype == "bfloat16":
        raw = (((x >> 8) & 0x80) | (x & 0x7F)).to(torch.uint8)
    else:
        raw = (x & 0xFF).to(torch.uint8)
    return coded, raw


def plan_code(x16: torch.Tensor, dtype: CodedDtype) -> SpanCode | None:
    """The smallest code of these elements (`x16`: int16, flat, on the CPU), or None where no code is smaller than
    the raw bytes."""
    n = x16.numel()
    coded, _ = split(x16, dtype)
    counts = torch.bincount(coded, minlength=256).sort(descending=True, stable=True).values.tolist()
    best: SpanCode | None = None
    for width in _FIELDS:
        escapes = n - sum(counts[: (1 << width) - 1])
        code = SpanCode(dtype, n, width, escape_capacity(escapes, n))
        if best is None or code.nbytes < best.nbytes:
            best = code
    return best if best.nbytes < 2 * n else None


def estimated_code(num_elements: int, dtype: CodedDtype) -> SpanCode:
    """A code whose size is about `ESTIMATED_CODED_FRACTION` of the raw bytes (for pricing only: it codes nothing)."""
    width = 3 if dtype == "bfloat16" else 6
    base = SpanCode(dtype, num_elements, width, 0).nbytes
    spare = max(0, int(ESTIMATED_CODED_FRACTION * 2 * num_elements) - base)
    return SpanCode(dtype, num_elements, width, spare // _ESCAPE_BYTES)


class CodeOverflowError(ValueError):
    """The values need more escapes than the code keeps (raised before anything is written)."""


def encode_into_(code: SpanCode, x16: torch.Tensor, out: torch.Tensor) -> int:
    """Write the code of `x16` (int16, flat, `code.num_elements`) into `out` (uint8, `code.nbytes`, on the CPU);
    the table is the 2^width - 1 most frequent coded bytes of these values. Returns the escapes used; raises
    `CodeOverflowError` (writing nothing) where they exceed the capacity."""
    n, dtype = code.num_elements, code.dtype
    x16 = x16.reshape(-1).cpu()
    coded, raw = split(x16, dtype)
    counts = torch.bincount(coded, minlength=256)
    ranked = counts.sort(descending=True, stable=True).indices[: code.escape_code]
    rank_of = torch.full((256,), code.escape_code, dtype=torch.uint8)
    rank_of[ranked] = torch.arange(ranked.numel(), dtype=torch.uint8)
    codes = rank_of.index_select(0, coded.to(torch.int32))
    positions = (codes == code.escape_code).nonzero().reshape(-1).to(torch.int32)
    if positions.numel() > code.capacity:
        raise CodeOverflowError(f"{positions.numel()} escapes needed, {code.capacity} kept")
    out[:n].copy_(raw)
    for w, shift, at in code.fields:
        per = 8 // w
        part = torch.zeros(-(-n // per) * per, dtype=torch.uint8)
        part[:n] = (codes >> shift) & ((1 << w) - 1)
        part = part.view(-1, per)
        packed = part[:, 0].clone()
        for j in range(1, per):
            packed |= part[:, j] << (j * w)
        out[at : at + packed.numel()].copy_(packed)
    high = (x16.to(torch.int32) & _HIGH_MASK[dtype])
    table = torch.zeros(1 << code.width, dtype=torch.int32)
    table[: ranked.numel()] = ranked.to(torch.int32) << _SHIFT[dtype]
    _int16_view(out, code.table_offset, 1 << code.width).copy_(_as_int16(table))
    pad = code.capacity - positions.numel()
    first = torch.zeros(pad, dtype=torch.int32)  # unused entries: element 0 with its own value
    all_positions = torch.cat([positions, first])
    out[code.escape_offset : code.escape_offset + 4 * code.capacity].view(torch.int32).copy_(all_positions)
    values = high.index_select(0, all_positions)
    _int16_view(out, code.escape_values_offset, code.capacity).copy_(_as_int16(values))
    return positions.numel()


def _as_int16(x32: torch.Tensor) -> torch.Tensor:
    """int32 values of 16 bits (0 to 65535) as the int16 with the same bits."""
    return torch.where(x32 >= 1 << 15, x32 - (1 << 16), x32).to(torch.int16)


def _int16_view(stored: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    return stored[offset : offset + 2 * count].view(torch.int16)


_scratch = threading.local()


def _scratch_for(device: torch.device, chunk: int) -> dict[str, torch.Tensor]:
    """This thread's decode scratch on `device` (the copy thread's, a restore's): no allocation per block."""
    per_device = getattr(_scratch, "buffers", None)
    if per_device is None:
        per_device = _scratch.buffers = {}
    key = (str(device), chunk)
    buffers = per_device.get(key)
    if buffers is None:
        with torch.inference_mode(False), torch.no_grad():
            buffers = per_device[key] = {
                "code": torch.empty(chunk, dtype=torch.uint8, device=device),
                "part": torch.empty(chunk, dtype=torch.uint8, device=device),
                "index": torch.empty(chunk, dtype=torch.int32, device=device),
                "high": torch.empty(chunk, dtype=torch.int16, device=device),
                "raw": torch.empty(chunk, dtype=torch.int16, device=device),
            }
    return buffers


class SpanDecode:
    """Decodes one span's stored bytes (`stored`, uint8 `code.nbytes`, 16-byte aligned as the form places them)
    into `out` (int16, `code.num_elements`), both views that keep their place (a slot's staging region and
    compute layout): planned once, run per copy."""

    def __init__(self, code: SpanCode, stored: torch.Tensor, out: torch.Tensor):
        self.code, self.out = code, out
        device = out.device
        with torch.inference_mode(False), torch.no_grad():
            self.raw = stored[: code.num_elements]
            self.fields = [(w, shift, stored[at : at + _align(-(-code.num_elements * w // 8))]) for w, shift, at in code.fields]
            self.table = _int16_view(stored, code.table_offset, 1 << code.width)
            positions = stored[code.escape_offset : code.escape_offset + 4 * code.capacity].view(torch.int32)
            self.positions = positions
            self.escape_values = _int16_view(stored, code.escape_values_offset, code.capacity)
            self.shifts = {w: torch.arange(0, 8, w, dtype=torch.uint8, device=device) for w in (1, 2, 4)}
        self.chunk = DECODE_CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "other"]

    def run_(self) -> torch.Tensor:
        code, out = self.code, self.out
        n = code.num_elements
        scratch = _scratch_for(out.device, self.chunk)
        raw_mask = _RAW_MASK16[code.dtype]
        for first in range(0, n, self.chunk):  # chunks are multiples of 8 elements: fields start on whole bytes
            count = min(self.chunk, n - first)
            codes = scratch["code"][:count]
            for i, (w, shift, field) in enumerate(self.fields):
                per = 8 // w
                nbytes = -(-count // per)
                source = field[first // per : first // per + nbytes].unsqueeze(1)
                target = scratch["code" if i == 0 else "part"][: nbytes * per].view(nbytes, per)
                torch.bitwise_right_shift(source, self.shifts[w], out=target)
                target.bitwise_and_((1 << w) - 1)
                if i > 0:
                    codes.bitwise_or_(target.view(-1)[:count].bitwise_left_shift_(shift))
            index = scratch["index"][:count]
            index.copy_(codes)  # zero-extended: index_select takes int32 indices
            high = torch.index_select(self.table, 0, index, out=scratch["high"][:count])
            raw = scratch["raw"][:count]
            if code.dtype == "bfloat16":
                raw.copy_(self.raw[first : first + count].view(torch.int8))  # sign-extended: the sign to bit 15
            else:
                raw.copy_(self.raw[first : first + count])
            raw.bitwise_and_(raw_mask)
            torch.bitwise_or(high, raw, out=out[first : first + count])
        # escapes last: the raw part of each escaped element is already in place, its high part replaces the table's
        positions = self.positions.long()
        fixed = out.index_select(0, positions).bitwise_and_(raw_mask).bitwise_or_(self.escape_values)
        out.index_copy_(0, positions, fixed)
        return out


def decode(code: SpanCode, stored: torch.Tensor) -> torch.Tensor:
    """The int16 elements coded in `stored` (a one-off `SpanDecode`, on the device `stored` is on)."""
    out = torch.empty(code.num_elements, dtype=torch.int16, device=stored.device)
    return SpanDecode(code, stored, out).run_()
