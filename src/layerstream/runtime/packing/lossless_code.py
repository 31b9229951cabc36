"""A lossless code for 16-bit floating-point tensors: on trained bfloat16 weights about 0.68x the bytes, within
a point or two of the exponent's entropy, bit for bit. Each element keeps a raw byte and codes the rest in tiers
of fixed-width codes, each tier's window the run of values holding the most of what reaches it (trained
exponents: about 2.8 bits of entropy, where one fixed width spent 3 or 4 bits and 6 bytes an escape); every
tier keeps a little room, so that values coded again (after LoRA fusing or a load) usually fit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from layerstream.errors import LayerstreamError
from layerstream.runtime.packing.lossless_decode import CHUNK_ELEMENTS, SpanDecode, decode, escapes_in
from layerstream.runtime.packing.lossless_format import (
    CODED_DTYPES, FIRST_WIDTHS, MAX_TIERS, SHIFT, TIER_WIDTHS, VALUE_RANGE, CodedDtype, SpanCode, best_window,
    choose_windows, pack_codes, tier_lookup, window_size,
)  # fmt: skip
from layerstream.runtime.packing.lossless_pricing import (
    ESTIMATED, ESTIMATED_CODED_FRACTION, CodedFraction, priced_fraction, pricing_at,
)  # fmt: skip

__all__ = [
    "CODED_DTYPES", "ESTIMATED", "ESTIMATED_CODED_FRACTION", "CodedFraction", "CodedDtype", "SpanCode", "SpanDecode",
    "count_coded", "decode", "encode_into_", "estimated_code", "plan_code", "plan_code_from_counts",
    "priced_fraction", "pricing_at",
]  # fmt: skip


def escape_capacity(num_escapes: int, num_elements: int) -> int:
    """Entries kept for a tier that needs `num_escapes`: a little more, so that a fused LoRA still fits."""
    return num_escapes + max(16, num_elements // 1024)


def count_coded(x16: torch.Tensor, dtype: CodedDtype) -> torch.Tensor:
    """How often each coded byte value occurs (int64, 256): what a code's tiers are picked from."""
    counts = torch.zeros(256, dtype=torch.int64)
    step = CHUNK_ELEMENTS["cpu"]
    wide = torch.empty(min(step, x16.numel()), dtype=torch.int16)
    coded = torch.empty(wide.numel(), dtype=torch.uint8)
    for first in range(0, x16.numel(), step):
        part = x16[first : first + step]
        torch.bitwise_right_shift(part, SHIFT[dtype], out=wide[: part.numel()])
        counts += torch.bincount(coded[: part.numel()].copy_(wide[: part.numel()]), minlength=256)  # the low 8 bits
    return counts


def value_counts(counts: torch.Tensor, dtype: CodedDtype) -> list[int]:
    """Counts of the coded values from those of the coded bytes (float16: the sign is not a coded value)."""
    return (counts if dtype == "bfloat16" else counts[:128] + counts[128:]).tolist()


def _layouts(
    left: list[int], escaping: int, widths: tuple[int, ...] = (), escapes: tuple[int, ...] = ()
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(widths, escapes per tier) of every layout of up to `MAX_TIERS` widths, each window the best of `left`."""
    for width in FIRST_WIDTHS if not widths else TIER_WIDTHS:
        base, inside = best_window(left, window_size(width))
        grown, after = widths + (width,), escapes + (escaping - inside,)
        yield grown, after
        if len(grown) < MAX_TIERS and escaping - inside > 0:
            yield from _layouts(left[:base] + left[base + window_size(width) :], escaping - inside, grown, after)


def plan_code_from_counts(counts: torch.Tensor, num_elements: int, dtype: CodedDtype) -> SpanCode | None:
    """The smallest code for these coded-byte `counts`, or None where none is smaller than the raw bytes; ties go
    to the layout found first (before its longer ones, which decode slower)."""
    values = value_counts(counts, dtype)
    first_bits = dtype == "float16"  # float16's sign rides in the first code
    best, best_bits = None, 0
    for widths, escapes in _layouts(values, sum(values)):  # sized in bits first: a code is made for the best only
        capacities = [escape_capacity(e, num_elements) for e in escapes]
        bits = num_elements * (widths[0] + first_bits) + sum(c * w for c, w in zip(capacities, widths[1:])) + 8 * capacities[-1]
        if best is None or bits < best_bits:
            best, best_bits = (widths, tuple(capacities)), bits
    code = SpanCode(dtype, num_elements, *best)
    return code if code.nbytes < 2 * num_elements else None


def plan_code(x16: torch.Tensor, dtype: CodedDtype) -> SpanCode | None:
    """The code of `x16` (int16, flat, on the CPU), or None where no code is smaller than the raw bytes."""
    return plan_code_from_counts(count_coded(x16, dtype), x16.numel(), dtype)


def estimated_code(num_elements: int, dtype: CodedDtype) -> SpanCode:
    """A code of about `priced_fraction()` of the raw bytes, for pricing only (it codes nothing)."""
    target = int(priced_fraction().value * 2 * num_elements)
    for width in sorted(FIRST_WIDTHS, reverse=True):
        bare = SpanCode(dtype, num_elements, (width,), (0,)).nbytes
        if bare <= target or width == min(FIRST_WIDTHS):
            return SpanCode(dtype, num_elements, (width,), (max(0, target - bare),))
    raise AssertionError("unreachable: the narrowest width always returns")


class _CodeOverflowError(LayerstreamError, ValueError):  # internal: the store turns it into UnsupportedUseError
    """The values need more entries in a tier than the code keeps (raised before anything is written)."""


class _EncodeScratch:
    """One encode's buffers for a step of `chunk` elements, made once per tensor."""

    def __init__(self, chunk: int):
        self.wide = torch.empty(chunk, dtype=torch.int16)
        self.wide2 = torch.empty(chunk, dtype=torch.int16)
        self.codes = torch.empty(chunk, dtype=torch.uint8)
        self.flags = torch.empty(chunk, dtype=torch.uint8)
        self.part = torch.empty(chunk, dtype=torch.uint8)


def _first_codes(x16: torch.Tensor, code: SpanCode, base: int, count: int, scratch: _EncodeScratch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tier 0's codes, escape flags) of a run of elements, padded with zero codes to `count` (scratch views)."""
    real, width = x16.numel(), code.widths[0]
    codes, flags = scratch.codes[:count], scratch.flags[:count]
    offsets = codes[:real]
    offsets.copy_(torch.bitwise_right_shift(x16, SHIFT[code.dtype], out=scratch.wide[:real]))  # the low 8 bits
    if code.dtype == "float16":
        sign = torch.bitwise_right_shift(offsets, 7, out=scratch.part[:real])
    offsets.sub_(base)  # wraps below the base to 256 - ..., which the clamp makes an escape
    if code.dtype == "float16":
        offsets.bitwise_and_(0x7F)  # the magnitude's offset, wrapped within 7 bits
    offsets.clamp_(max=window_size(width))
    codes[real:].zero_()
    torch.add(codes, 1, out=flags).bitwise_right_shift_(width)  # 1 exactly at the escape offset (all ones)
    if code.dtype == "float16":
        offsets.bitwise_or_(sign.bitwise_left_shift_(width))
    return codes, flags


def _raw_into_(x16: torch.Tensor, dtype: CodedDtype, out: torch.Tensor, scratch: _EncodeScratch) -> None:
    """The raw byte of a run of elements into `out`: bfloat16's sign (bit 7) and mantissa, float16's low byte."""
    if dtype == "float16":
        out.copy_(x16)  # the narrowing keeps the low 8 bits
        return
    count = x16.numel()
    kept = torch.bitwise_and(x16, -32641, out=scratch.wide[:count])  # 0x807F: the sign and the mantissa bits
    kept.bitwise_or_(torch.bitwise_right_shift(kept, 8, out=scratch.wide2[:count]))  # the sign in bit 7
    out.copy_(kept)


def _pack_field_(codes: torch.Tensor, out: torch.Tensor, bits: int, shift: int, scratch: torch.Tensor) -> None:
    """Bits shift .. shift + bits - 1 of `codes` into `out`, planar: byte j holds elements j, j + P, ... of a block."""
    length = out.shape[1]
    part = torch.bitwise_right_shift(codes, shift, out=scratch).bitwise_and_((1 << bits) - 1)
    out.copy_(part[:, :length])
    for plane in range(1, 8 // bits):
        out.bitwise_or_(part[:, plane * length : (plane + 1) * length].bitwise_left_shift_(plane * bits))


def _coded_values(x16: torch.Tensor, dtype: CodedDtype) -> torch.Tensor:
    """The coded value of each element (uint8): bfloat16's exponent, float16's high byte less its sign."""
    return torch.bitwise_right_shift(x16, SHIFT[dtype]).bitwise_and_(VALUE_RANGE[dtype] - 1).to(torch.uint8)


def _later_tiers(code: SpanCode, bases: list[int], escaped: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Each later tier's codes, then the literals, and every tier's escapes; `_CodeOverflowError` past a capacity."""
    out, escapes = [], [escaped.numel()]
    for tier in range(1, len(code.widths) + 1):
        if escaped.numel() > code.capacities[tier - 1]:
            raise _CodeOverflowError(f"tier {tier}: {escaped.numel()} entries needed, {code.capacities[tier - 1]} kept")
        if tier == len(code.widths):
            out.append(escaped)
            break
        codes = tier_lookup(bases, code.widths, tier, VALUE_RANGE[code.dtype]).index_select(0, escaped.long())
        out.append(codes)
        escaped = escaped[codes == window_size(code.widths[tier])]
        escapes.append(escaped.numel())
    return out, escapes


def encode_into_(code: SpanCode, x16: torch.Tensor, out: torch.Tensor, counts: torch.Tensor | None = None) -> int:
    """Code `x16` into `out` (windows of `counts` where given); tier 0's escapes, or `_CodeOverflowError` first."""
    n, dtype = code.num_elements, code.dtype
    x16 = x16.reshape(-1).cpu()
    bases, expected = choose_windows(value_counts(count_coded(x16, dtype) if counts is None else counts, dtype), code.widths)
    share = expected[0] / n  # of the elements escaping tier 0, as the windows' counts say: how to look for them
    chunk = CHUNK_ELEMENTS["cpu"]
    scratch = _EncodeScratch(min(chunk, code.padded_elements))
    fields_at = code.fields[0][2]
    fields = torch.empty(code.bases_offset - fields_at, dtype=torch.uint8)  # the field bytes, kept until checked
    escaped = []  # the coded values of tier 0's escapes, in order
    for first, blocks, block in code.steps(chunk):
        count = blocks * block
        part = x16[first : min(n, first + count)]
        codes, flags = _first_codes(part, code, bases[0], count, scratch)
        escaped.append(_coded_values(part.index_select(0, escapes_in(flags.view(torch.bool)[: part.numel()], share)), dtype))
        for bits, shift, at in code.fields:
            start = at - fields_at + first * bits // 8
            packed = fields[start : start + count * bits // 8].view(blocks, block * bits // 8)
            _pack_field_(codes.view(blocks, block), packed, bits, shift, scratch.part[:count].view(blocks, block))
    tiers, escapes = _later_tiers(code, bases, torch.cat(escaped))  # raises before anything is written
    for first in range(0, n, chunk):
        _raw_into_(x16[first : first + chunk], dtype, out[first : min(n, first + chunk)], scratch)
    out[fields_at : code.bases_offset].copy_(fields)
    header = out[code.bases_offset : code.tier_offsets[0]].view(torch.int32)
    header.zero_()
    header[: len(bases)] = torch.tensor(bases, dtype=torch.int32)
    header[len(bases) : 2 * len(bases)] = torch.tensor(escapes, dtype=torch.int32)
    for tier, (codes, at) in enumerate(zip(tiers, code.tier_offsets), start=1):
        region = out[at : (code.tier_offsets + (code.nbytes,))[tier]]
        region.zero_()
        if tier < len(code.widths):
            pack_codes(codes, code.widths[tier], code.capacities[tier - 1], region)
        else:
            region[: codes.numel()] = codes
    return escapes[0]
