"""A lossless code for 16-bit floating-point tensors (bfloat16, float16): about 0.7x the bytes, bit for bit.

Each 16-bit element is split into a raw byte, kept as it is (bfloat16: the sign and the seven mantissa bits;
float16: the low byte), and a coded byte (bfloat16: the exponent; float16: the high byte: the sign, the exponent
and two mantissa bits), whose values are few in a weight tensor (a normal weight's exponents carry about 2.6 bits)
and next to each other. The coded byte becomes a fixed-width code of `width` bits (2, 3, 4 or 6): its offset from
the tensor's `base` within a window of the 2^width - 1 values (float16: the sign bit, then the offset of the rest
within a window of 2^(width - 1) - 1), the window that holds the most elements; the last offset is an escape,
whose element is listed whole beside its position in an escape list. The elements after the last whole group of
16 are always escapes. A `SpanCode` is the plan of one tensor's code (its sizes are fixed when it is made, so
every offset is known without reading the bytes); its stored bytes are:

    raw bytes (n) | a field of 4, 2 or 1 bits per code for each part of the width (4 = 4, 6 = 4 + 2, 3 = 2 + 1,
    2 = 2) | base (int16) | escape positions (int32, `capacity`) | escape values (int16, `capacity`)

A field is planar within each block of `BLOCK_ELEMENTS` elements: byte j of a block's field holds the bits of
elements j, j + P, j + 2P, ... (P the block's bytes of that field), so that unpacking a plane is one shift of a
contiguous run of bytes into a contiguous run of codes. Decoding is, per chunk, a few contiguous shifts and masks
per field, an add of the base, a widening, a shift, and one `or` with the widened raw bytes; then one scatter of
the escapes: plain torch ops on any device, with no lookup, no custom kernel and no host sync. Every bit of every
element is either kept or computed back from its code by the inverse of the encode's integer steps, and every
element whose coded byte is not in the window is written whole from the escape list, so the code is exact by
construction. The escape list has `capacity` entries, a little more than the tensor needs when it is coded (so a
re-encode after LoRA fusing or a load usually fits); unused entries repeat the first element with its own value,
which writes nothing new.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

from layerstream.errors import LayerstreamError

CodedDtype = Literal["bfloat16", "float16"]
CODED_DTYPES: dict[torch.dtype, CodedDtype] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

_SHIFT = {"bfloat16": 7, "float16": 8}
"""Where the coded byte sits in the 16-bit element."""
_RAW_MASK16 = {"bfloat16": -32641, "float16": 0x00FF}  # 0x807F as int16: the sign and the mantissa bits
_FIELDS: dict[int, tuple[int, ...]] = {2: (2,), 3: (2, 1), 4: (4,), 6: (4, 2)}
"""A code width as fields of 4, 2 and 1 bits. Widths 1, 5 and 7 are not offered: measured on the benchmark's Wan
block in bfloat16 and float16, no tensor codes smaller with them."""
WIDTHS = tuple(_FIELDS)
GROUP_ELEMENTS = 16
"""Elements are coded in whole groups of 16 (the escape search reads 8 flags per 64-bit word); the rest escape."""
BLOCK_ELEMENTS = 1 << 13
"""Elements per planar block (the last block of a tensor is shorter): a plane is 1,024 to 4,096 bytes long."""
_ALIGN = 16
_ESCAPE_BYTES = 6  # an int32 position and an int16 value

CHUNK_ELEMENTS = {"cpu": 1 << 18, "other": 1 << 22}
"""Elements coded or decoded per step (whole blocks): on the CPU the step's scratch (4 bytes an element) stays in
the core's cache while a step's few dozen torch calls cost little beside it; on an accelerator a step's scratch
stays small beside the slot ring."""

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
    """Bits per code, one of `WIDTHS`."""
    capacity: int
    """Escape entries kept."""

    def __post_init__(self) -> None:
        assert self.width in _FIELDS, f"code width {self.width}: one of {WIDTHS}"

    @property
    def coded_elements(self) -> int:
        """Elements coded in the fields (whole groups); the rest are always escapes."""
        return self.num_elements - self.num_elements % GROUP_ELEMENTS

    @property
    def offset_bits(self) -> int:
        """Bits of the offset within the window (float16's code also holds the sign)."""
        return self.width if self.dtype == "bfloat16" else self.width - 1

    @property
    def escape_offset_value(self) -> int:
        """The offset that marks an escape (the window holds the offsets below it)."""
        return (1 << self.offset_bits) - 1

    @property
    def fields(self) -> tuple[tuple[int, int, int], ...]:
        """(field bits, the code bit it holds first, byte offset) of each field."""
        out, shift, at = [], 0, _align(self.num_elements)
        for bits in _FIELDS[self.width]:
            out.append((bits, shift, at))
            shift += bits
            at += _align(self.coded_elements * bits // 8)
        return tuple(out)

    @property
    def base_offset(self) -> int:
        bits, _, at = self.fields[-1]
        return at + _align(self.coded_elements * bits // 8)

    @property
    def escape_offset(self) -> int:
        return self.base_offset + _ALIGN

    @property
    def escape_values_offset(self) -> int:
        return self.escape_offset + _align(4 * self.capacity)

    @property
    def nbytes(self) -> int:
        return self.escape_values_offset + _align(2 * self.capacity)

    def steps(self, chunk: int) -> list[tuple[int, int, int]]:
        """(first element, blocks, elements a block) of each step of at most `chunk` elements over the coded
        elements: whole blocks, then the last, shorter block."""
        full, last = divmod(self.coded_elements, BLOCK_ELEMENTS)
        per = max(1, chunk // BLOCK_ELEMENTS)
        out = [(b * BLOCK_ELEMENTS, min(per, full - b), BLOCK_ELEMENTS) for b in range(0, full, per)]
        if last:
            out.append((full * BLOCK_ELEMENTS, 1, last))
        return out


def coded_bytes(x16: torch.Tensor, dtype: CodedDtype) -> torch.Tensor:
    """The coded byte of each element (`x16`: int16, flat): bfloat16's exponent, float16's high byte."""
    return torch.bitwise_right_shift(x16, _SHIFT[dtype]).to(torch.uint8)  # the narrowing keeps the low 8 bits


def raw_bytes(x16: torch.Tensor, dtype: CodedDtype) -> torch.Tensor:
    """The raw byte of each element: bfloat16's sign and mantissa bits (sign in bit 7), float16's low byte."""
    if dtype == "float16":
        return x16.to(torch.uint8)  # the narrowing keeps the low 8 bits
    kept = torch.bitwise_and(x16, _RAW_MASK16["bfloat16"])
    return kept.bitwise_or_(kept >> 8).to(torch.uint8)  # the arithmetic shift puts the sign in bit 7


def split(x16: torch.Tensor, dtype: CodedDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(coded bytes, raw bytes) of 16-bit elements (`x16`: int16, flat)."""
    return coded_bytes(x16, dtype), raw_bytes(x16, dtype)


def count_coded(x16: torch.Tensor, dtype: CodedDtype) -> torch.Tensor:
    """How often each coded byte value occurs (int64, 256): what a code's width and window are picked from."""
    counts = torch.zeros(256, dtype=torch.int64)
    step = CHUNK_ELEMENTS["cpu"]
    wide = torch.empty(min(step, x16.numel()), dtype=torch.int16)
    coded = torch.empty(wide.numel(), dtype=torch.uint8)
    for first in range(0, x16.numel(), step):
        part = x16[first : first + step]
        torch.bitwise_right_shift(part, _SHIFT[dtype], out=wide[: part.numel()])
        counts += torch.bincount(coded[: part.numel()].copy_(wide[: part.numel()]), minlength=256)  # the low 8 bits
    return counts


def _window(counts: torch.Tensor, dtype: CodedDtype, width: int) -> tuple[int, int]:
    """(base, elements inside) of the window of offsets of `width`'s code that holds the most elements."""
    values = counts if dtype == "bfloat16" else counts[:128] + counts[128:]  # float16: the sign is in the code
    size = (1 << (width if dtype == "bfloat16" else width - 1)) - 1
    sums = torch.cat([torch.zeros(1, dtype=torch.int64), values.cumsum(0)])
    inside = sums[size:] - sums[:-size]  # inside[b]: elements of values b .. b + size - 1
    base = int(inside.argmax())
    return base, int(inside[base])


def plan_code_from_counts(counts: torch.Tensor, num_elements: int, dtype: CodedDtype) -> SpanCode | None:
    """The smallest code of `num_elements` elements with these coded-byte `counts`, or None where no code is
    smaller than the raw bytes: each width's size is known from the counts (its escapes are the elements outside
    its best window, and those after the last whole group)."""
    tail = num_elements % GROUP_ELEMENTS
    best: SpanCode | None = None
    for width in WIDTHS:
        escapes = min(num_elements, num_elements - _window(counts, dtype, width)[1] + tail)
        code = SpanCode(dtype, num_elements, width, escape_capacity(escapes, num_elements))
        if best is None or code.nbytes < best.nbytes:
            best = code
    return best if best.nbytes < 2 * num_elements else None


def plan_code(x16: torch.Tensor, dtype: CodedDtype) -> SpanCode | None:
    """The smallest code of these elements (`x16`: int16, flat, on the CPU), or None where no code is smaller than
    the raw bytes."""
    return plan_code_from_counts(count_coded(x16, dtype), x16.numel(), dtype)


def estimated_code(num_elements: int, dtype: CodedDtype) -> SpanCode:
    """A code whose size is about `ESTIMATED_CODED_FRACTION` of the raw bytes (for pricing only: it codes nothing)."""
    width = 3 if dtype == "bfloat16" else 6
    base = SpanCode(dtype, num_elements, width, 0).nbytes
    spare = max(0, int(ESTIMATED_CODED_FRACTION * 2 * num_elements) - base)
    return SpanCode(dtype, num_elements, width, spare // _ESCAPE_BYTES)


class _CodeOverflowError(LayerstreamError, ValueError):  # internal: the store turns it into UnsupportedUseError
    """The values need more escapes than the code keeps (raised before anything is written)."""


class _EncodeScratch:
    """One encode's buffers for a step of `chunk` elements (the step's work stays in the core's cache)."""

    def __init__(self, chunk: int):
        self.wide = torch.empty(chunk, dtype=torch.int16)
        self.wide2 = torch.empty(chunk, dtype=torch.int16)
        self.codes = torch.empty(chunk, dtype=torch.uint8)
        self.flags = torch.empty(chunk, dtype=torch.uint8)
        self.part = torch.empty(chunk, dtype=torch.uint8)


def _codes_of(x16: torch.Tensor, code: SpanCode, base: int, scratch: _EncodeScratch) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, escape flags) of a run of elements: uint8 each (scratch views), the flag 1 where the coded byte is
    outside the window."""
    count = x16.numel()
    offsets, flags = scratch.codes[:count], scratch.flags[:count]
    offsets.copy_(torch.bitwise_right_shift(x16, _SHIFT[code.dtype], out=scratch.wide[:count]))  # the low 8 bits
    if code.dtype == "float16":
        sign = torch.bitwise_right_shift(offsets, 7, out=scratch.part[:count])
    offsets.sub_(base)  # wraps below the base to 256 - ..., which the clamp makes an escape
    if code.dtype == "float16":
        offsets.bitwise_and_(0x7F)  # the magnitude's offset, wrapped within 7 bits
    offsets.clamp_(max=code.escape_offset_value)
    torch.add(offsets, 1, out=flags).bitwise_right_shift_(code.offset_bits)  # 1 exactly at the escape offset (all ones)
    if code.dtype == "float16":
        offsets.bitwise_or_(sign.bitwise_left_shift_(code.offset_bits))
    return offsets, flags


def _raw_into_(x16: torch.Tensor, dtype: CodedDtype, out: torch.Tensor, scratch: _EncodeScratch) -> None:
    """`raw_bytes` of a run of elements, into `out`."""
    if dtype == "float16":
        out.copy_(x16)  # the narrowing keeps the low 8 bits
        return
    count = x16.numel()
    kept = torch.bitwise_and(x16, _RAW_MASK16["bfloat16"], out=scratch.wide[:count])
    kept.bitwise_or_(torch.bitwise_right_shift(kept, 8, out=scratch.wide2[:count]))  # the sign in bit 7
    out.copy_(kept)


def _escapes_in(flags: torch.Tensor) -> torch.Tensor:
    """Positions (int64) of the ones in `flags` (uint8 0/1, a multiple of 8 long): found 8 at a time (a 64-bit word),
    then one at a time within the words that hold any."""
    words = flags.view(torch.int64).nonzero().reshape(-1)
    if words.numel() == 0:
        return words
    candidates = (words.unsqueeze(1) * 8 + torch.arange(8)).reshape(-1)
    return candidates[flags.index_select(0, candidates).bool()]


def _pack_field_(codes: torch.Tensor, out: torch.Tensor, bits: int, shift: int, scratch: torch.Tensor) -> None:
    """Bits shift .. shift + bits - 1 of `codes` (uint8, blocks x elements) into `out` (uint8, blocks x bytes),
    planar: byte j holds the bits of elements j, j + P, ... (P = out's bytes a block)."""
    length = out.shape[1]
    part = torch.bitwise_right_shift(codes, shift, out=scratch).bitwise_and_((1 << bits) - 1)
    out.copy_(part[:, :length])
    for plane in range(1, 8 // bits):
        out.bitwise_or_(part[:, plane * length : (plane + 1) * length].bitwise_left_shift_(plane * bits))


def encode_into_(code: SpanCode, x16: torch.Tensor, out: torch.Tensor, counts: torch.Tensor | None = None) -> int:
    """Write the code of `x16` (int16, flat, `code.num_elements`) into `out` (uint8, `code.nbytes`, on the CPU);
    the window is the one of `counts` (where given: made from the same or other values, the code is exact with any
    window) or of these values. Returns the escapes used; raises `_CodeOverflowError` (writing nothing) where they
    exceed the capacity."""
    n, coded_n, dtype = code.num_elements, code.coded_elements, code.dtype
    x16 = x16.reshape(-1).cpu()
    base = _window(count_coded(x16, dtype) if counts is None else counts, dtype, code.width)[0]
    chunk = CHUNK_ELEMENTS["cpu"]
    scratch = _EncodeScratch(min(chunk, max(n, GROUP_ELEMENTS)))
    fields_at = code.fields[0][2]
    fields = torch.empty(code.base_offset - fields_at, dtype=torch.uint8)  # the field bytes, kept until checked
    found = [torch.arange(coded_n, n)]  # after the last whole group: always escapes
    for first, blocks, block in code.steps(chunk):
        count = blocks * block
        codes, flags = _codes_of(x16[first : first + count], code, base, scratch)
        found.append(_escapes_in(flags) + first)
        for bits, shift, at in code.fields:
            start = at - fields_at + first * bits // 8
            packed = fields[start : start + count * bits // 8].view(blocks, block * bits // 8)
            _pack_field_(codes.view(blocks, block), packed, bits, shift, scratch.part[:count].view(blocks, block))
    positions = torch.cat(found).to(torch.int32)
    if positions.numel() > code.capacity:
        raise _CodeOverflowError(f"{positions.numel()} escapes needed, {code.capacity} kept")
    for first in range(0, n, chunk):
        _raw_into_(x16[first : first + chunk], dtype, out[first : min(n, first + chunk)], scratch)
    out[fields_at : code.base_offset].copy_(fields)
    _int16_view(out, code.base_offset, 1).fill_(base)
    padded = torch.cat([positions, torch.zeros(code.capacity - positions.numel(), dtype=torch.int32)])
    out[code.escape_offset : code.escape_offset + 4 * code.capacity].view(torch.int32).copy_(padded)
    _int16_view(out, code.escape_values_offset, code.capacity).copy_(x16.index_select(0, padded))
    return positions.numel()


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
                "codes": torch.empty(chunk, dtype=torch.uint8, device=device),
                "part": torch.empty(chunk, dtype=torch.uint8, device=device),
                "raw": torch.empty(chunk, dtype=torch.int16, device=device),
            }
    return buffers


class SpanDecode:
    """Decodes one span's stored bytes (`stored`, uint8 `code.nbytes`, 16-byte aligned as the form places them)
    into `out` (int16, `code.num_elements`), both views that keep their place (a slot's staging region and
    compute layout): planned once, run per copy."""

    def __init__(self, code: SpanCode, stored: torch.Tensor, out: torch.Tensor):
        self.code, self.out = code, out
        with torch.inference_mode(False), torch.no_grad():
            self.raw = stored[: code.num_elements]
            self.fields = [(bits, shift, stored[at : at + code.coded_elements * bits // 8]) for bits, shift, at in code.fields]
            self.base16 = _int16_view(stored, code.base_offset, 1)
            self.base = stored[code.base_offset : code.base_offset + 1]  # the low byte: uint8, for the add
            self.positions = stored[code.escape_offset : code.escape_offset + 4 * code.capacity].view(torch.int32)
            self.escape_values = _int16_view(stored, code.escape_values_offset, code.capacity)
        self.on_cpu = out.device.type == "cpu"
        self.chunk = CHUNK_ELEMENTS["cpu" if self.on_cpu else "other"]
        self.steps = code.steps(self.chunk)

    def run_(self) -> torch.Tensor:
        code, out = self.code, self.out
        scratch = _scratch_for(out.device, self.chunk)
        # on the CPU the base is read here (no device to wait for); elsewhere it is added as a one-element tensor
        base = int(self.base16.item()) if self.on_cpu else self.base
        for first, blocks, block in self.steps:
            count = blocks * block
            codes = scratch["codes"][:count].view(blocks, block)
            for bits, shift, field in self.fields:
                length = block * bits // 8
                packed = field[first * bits // 8 : first * bits // 8 + blocks * length].view(blocks, length)
                target = codes if shift == 0 else scratch["part"][:count].view(blocks, block)
                self._unpack_(packed, target, bits, shift, length)
                if shift:
                    codes.bitwise_or_(target)
            codes = codes.view(-1)
            if code.dtype == "float16":  # the sign bit from the code's top to bit 7 of the high byte
                sign = torch.bitwise_right_shift(codes, code.offset_bits, out=scratch["part"][:count])
                codes.add_(sign.mul_(128 - (1 << code.offset_bits)))
            codes.add_(base)  # the coded byte (escapes: some value, written over below)
            target = out[first : first + count]
            target.copy_(codes).bitwise_left_shift_(_SHIFT[code.dtype])  # zero-extended, then into place
            raw = scratch["raw"][:count]
            if code.dtype == "bfloat16":
                raw.copy_(self.raw[first : first + count].view(torch.int8)).bitwise_and_(_RAW_MASK16["bfloat16"])
            else:
                raw.copy_(self.raw[first : first + count])  # zero-extended: the low byte
            target.bitwise_or_(raw)
        # escapes last, whole elements (the unused entries rewrite element 0 with its own value)
        out.index_put_((self.positions,), self.escape_values)
        return out

    @staticmethod
    def _unpack_(packed: torch.Tensor, target: torch.Tensor, bits: int, shift: int, length: int) -> None:
        """Code bits shift .. shift + bits - 1 from a planar field into `target` (uint8, blocks x elements), the
        other bits zero."""
        for plane in range(8 // bits):
            into = target[:, plane * length : (plane + 1) * length]
            moved = plane * bits - shift  # where the plane's bits are, against where they go
            if moved > 0:
                torch.bitwise_right_shift(packed, moved, out=into)
            elif moved < 0:
                torch.bitwise_left_shift(packed, -moved, out=into)  # the uint8 shift drops the bits above
            else:
                into.copy_(packed)
        target.bitwise_and_(((1 << bits) - 1) << shift)


def decode(code: SpanCode, stored: torch.Tensor) -> torch.Tensor:
    """The int16 elements coded in `stored` (a one-off `SpanDecode`, on the device `stored` is on)."""
    out = torch.empty(code.num_elements, dtype=torch.int16, device=stored.device)
    return SpanDecode(code, stored, out).run_()
