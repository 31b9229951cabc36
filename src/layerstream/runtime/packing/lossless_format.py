"""The stored form of the lossless code of one 16-bit tensor (`SpanCode`) and the tiers of windows it codes in.
Each element is a raw byte (bfloat16: sign and mantissa; float16: the low byte) and a coded value (bfloat16: the
exponent; float16: the high byte less its sign, which rides atop the first code). Tier 0 gives every element a
`widths[0]`-bit offset in the first window of 2^width - 1 values, all ones marking an escape; tier k codes the
escapes of tier k - 1, in order, in a window of the values no earlier window holds; the last tier's escapes are
literals. Positions are never stored: they follow from counting the escapes before. The stored bytes, each region
16-byte aligned, tier 0's fields planar within blocks of `BLOCK_ELEMENTS` over whole groups of 16 elements:

    raw bytes (n) | tier 0: fields of 4, 2 and 1 bits | window bases, then escape counts (int32, one per tier) |
    tier 1, 2, ...: codes, planar | literals (one byte each)
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

CodedDtype = Literal["bfloat16", "float16"]
CODED_DTYPES: dict[torch.dtype, CodedDtype] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

SHIFT = {"bfloat16": 7, "float16": 8}  # where the coded byte sits in the 16-bit element
RAW_MASK16 = {"bfloat16": -32641, "float16": 0x00FF}  # 0x807F as int16: the sign and the mantissa bits
VALUE_RANGE = {"bfloat16": 256, "float16": 128}  # coded values (float16's sign rides in the first code)
FIELDS: dict[int, tuple[int, ...]] = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1)}  # tier 0's code bits
FIRST_WIDTHS = (1, 2, 3, 4)  # tier 0's; wider ones never code a trained tensor smaller (the benchmark's weights)
TIER_WIDTHS = (1, 2, 4)  # the later tiers': whole codes per byte, one shift per code of a byte to unpack
MAX_TIERS = 3  # before the literals; a fourth gains 0.3 points of the bfloat16 bytes on trained weights
GROUP_ELEMENTS = 16  # tier 0 codes whole groups of 16 elements (the escape search reads 8 flags per 64-bit word)
BLOCK_ELEMENTS = 1 << 13
"""Elements per planar block (the last block of a tensor is shorter): a plane is 1,024 to 4,096 bytes long."""
ALIGN = 16


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class SpanCode:
    """The sizes of one tensor's code, fixed when it is planned; the windows are chosen when values are coded."""

    dtype: CodedDtype
    num_elements: int
    widths: tuple[int, ...]  # bits per code: `widths[0]` for every element, `widths[k]` for tier k - 1's escapes
    capacities: tuple[int, ...]  # codes kept for tiers 1 .. len(widths) - 1, then the literals kept

    def __post_init__(self) -> None:
        assert self.widths[0] in FIRST_WIDTHS, f"first width {self.widths[0]}: one of {FIRST_WIDTHS}"
        assert all(w in TIER_WIDTHS for w in self.widths[1:]), f"tier widths {self.widths[1:]}: of {TIER_WIDTHS}"
        assert len(self.capacities) == len(self.widths), "one capacity per later tier, and the literals'"
        assert sum(window_size(w) for w in self.widths) <= VALUE_RANGE[self.dtype], "windows beyond the values"

    @property
    def padded_elements(self) -> int:
        return -(-self.num_elements // GROUP_ELEMENTS) * GROUP_ELEMENTS  # tier 0 codes whole groups

    @cached_property
    def fields(self) -> tuple[tuple[int, int, int], ...]:
        """(field bits, the code bit it holds first, byte offset) of each field of tier 0."""
        out, shift, at = [], 0, align(self.num_elements)
        for bits in FIELDS[self.widths[0] + (self.dtype == "float16")]:  # float16's sign above the offset
            out.append((bits, shift, at))
            shift += bits
            at += align(self.padded_elements * bits // 8)
        return tuple(out)

    @cached_property
    def bases_offset(self) -> int:
        bits, _, at = self.fields[-1]
        return at + align(self.padded_elements * bits // 8)

    @cached_property
    def tier_offsets(self) -> tuple[int, ...]:
        """Byte offset of each later tier's codes, then of the literals."""
        out, at = [], self.bases_offset + align(8 * len(self.widths))  # a base and an escape count per tier (int32)
        for width, capacity in zip(self.widths[1:], self.capacities):
            out.append(at)
            at += align(plane_bytes(capacity, width))
        out.append(at)
        return tuple(out)

    @cached_property
    def nbytes(self) -> int:
        return self.tier_offsets[-1] + align(self.capacities[-1])

    @property
    def signature(self) -> str:
        return f"{'.'.join(map(str, self.widths))}/{'.'.join(map(str, self.capacities))}"  # ranks compare it

    def steps(self, chunk: int) -> list[tuple[int, int, int]]:
        """(first element, blocks, elements a block) of each step of at most `chunk` of tier 0's elements."""
        full, last = divmod(self.padded_elements, BLOCK_ELEMENTS)
        per = max(1, chunk // BLOCK_ELEMENTS)
        out = [(b * BLOCK_ELEMENTS, min(per, full - b), BLOCK_ELEMENTS) for b in range(0, full, per)]
        if last:
            out.append((full * BLOCK_ELEMENTS, 1, last))
        return out


def window_size(width: int) -> int:
    """Values a window of `width`-bit codes holds (all ones is the escape)."""
    return (1 << width) - 1


def best_window(left: list[int], size: int) -> tuple[int, int]:
    """(base, elements inside) of the first run of `size` consecutive counts of `left` that holds the most."""
    sums = [0, *itertools.accumulate(left)]
    inside = list(map(operator.sub, sums[size:], sums[: len(sums) - size]))
    base = max(range(len(inside)), key=inside.__getitem__)
    return base, inside[base]


def choose_windows(value_counts: list[int], widths: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(base of each tier's window, elements escaping each tier), each window the best of what is left."""
    left = list(value_counts)  # the counts of the values no window holds yet, in order
    escaping = sum(left)
    bases, escapes = [], []
    for width in widths:
        base, inside = best_window(left, window_size(width))
        bases.append(base)
        escaping -= inside
        escapes.append(escaping)
        del left[base : base + window_size(width)]
    return bases, escapes


def tier_lookup(bases: list[int], widths: tuple[int, ...], tier: int, value_range: int) -> torch.Tensor:
    """Tier `tier`'s code of each value: its offset in the tier's window, all ones where the window misses it."""
    left = list(range(value_range))
    for base, width in zip(bases[:tier], widths[:tier]):
        del left[base : base + window_size(width)]
    escape = window_size(widths[tier])
    codes = [escape] * value_range
    for offset, value in enumerate(left[bases[tier] : bases[tier] + escape]):
        codes[value] = offset
    return torch.tensor(codes, dtype=torch.uint8)


def restore_values_(values: torch.Tensor, bases: list, widths: tuple[int, ...], tier: int) -> torch.Tensor:
    """Tier `tier`'s values back to coded values, in place, putting each earlier window back (the last first);
    `bases` are ints on the CPU, one-element tensors on a device (no host sync)."""
    for k in range(tier - 1, -1, -1):
        base, size = bases[k], window_size(widths[k])
        if not isinstance(base, int):
            values.add_(torch.ge(values, base), alpha=size)
        elif base == 0:
            values.add_(size)
        else:  # 1 where values >= base: clamps, which torch's CPU kernels vectorize (its comparisons: 10x slower)
            values.add_(torch.clamp(values, min=base - 1).sub_(base - 1).clamp_(max=1), alpha=size)
    return values


def plane_bytes(capacity: int, width: int) -> int:
    """Bytes of a later tier of `capacity` codes of `width` bits: its plane length P (see `pack_codes`)."""
    return -(-capacity * width // 8)


def pack_codes(codes: torch.Tensor, width: int, capacity: int, out: torch.Tensor) -> None:
    """`codes` (uint8, each below 2^width, at most `capacity`) into `out` (uint8, P = `plane_bytes` long), planar:
    code i is in byte i % P, at bit (i // P) * width, so a run of codes is a run of bytes of one or two planes."""
    length = plane_bytes(capacity, width)
    padded = torch.zeros(length * (8 // width), dtype=torch.uint8)
    padded[: codes.numel()] = codes
    planes = padded.view(8 // width, length)
    out[:length] = planes[0]
    for plane in range(1, 8 // width):
        out[:length].bitwise_or_(planes[plane] << (plane * width))


def unpack_codes(packed: torch.Tensor, width: int, capacity: int, start: int, count: int) -> torch.Tensor:
    """Codes start .. start + count - 1 of `packed` (`pack_codes`'s bytes): uint8, `count`, contiguous shifts."""
    length = plane_bytes(capacity, width)
    out = torch.empty(count, dtype=torch.uint8, device=packed.device)
    at = start
    while at < start + count:
        plane, offset = divmod(at, length)
        take = min(start + count - at, length - offset)
        torch.bitwise_right_shift(packed[offset : offset + take], plane * width, out=out[at - start : at - start + take])
        at += take
    return out.bitwise_and_((1 << width) - 1)
