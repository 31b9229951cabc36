"""Decoding the lossless code (`lossless_format`) with plain torch ops, on any device, with no host sync there.
On the CPU a chunk's escapes are found and counted and each tier works on those alone; on an accelerator, where a
count would wait for the device, every element's place in the next tier is its running count of escapes (a
cumulative sum), carried from chunk to chunk as device tensors.
"""

from __future__ import annotations

import threading

import torch

try:
    import numpy as _np
except ImportError:  # torch finds the escapes too, slower
    _np = None

from layerstream.runtime.packing.lossless_format import (
    RAW_MASK16, SHIFT, SpanCode, plane_bytes, restore_values_, unpack_codes,
)  # fmt: skip

CHUNK_ELEMENTS = {"cpu": 1 << 20, "other": 1 << 22}
"""Elements coded or decoded per step (whole blocks): on the CPU a step's few dozen torch calls cost little beside
its work (a trained tensor decoded at 0.8-1.1 GB/s in steps of 2^18 elements, 0.9-1.35 in steps of 2^20, on one
core); on an accelerator a step's scratch (about 20 bytes an element: the ranks and indices) stays small beside
the slot ring."""
SPARSE_SHARE = 0.01  # below this share, escapes are looked for a 64-bit word at a time (most words hold none)

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
                "escaped": torch.empty(chunk, dtype=torch.uint8, device=device),
                "raw": torch.empty(chunk, dtype=torch.int16, device=device),
            }
    return buffers


def escapes_in(flags: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    """Positions (int64, ascending) of the true elements of `flags` (bool, on the CPU), about `share` of them.
    Rare ones are found 8 at a time (a 64-bit word), then one at a time within the words that hold any; others by
    numpy's scan of a bool array where numpy is there (per 2^18 elements on one core, 30% true: 0.4-0.7 ns an
    element; torch's `nonzero`: 3-4)."""
    if share < SPARSE_SHARE and flags.numel() % 8 == 0:
        words = _nonzero(flags.view(torch.int64))
        if words.numel() == 0:
            return words
        candidates = (words.unsqueeze(1) * 8 + torch.arange(8)).reshape(-1)
        return candidates[_nonzero(flags.index_select(0, candidates))]
    return _nonzero(flags)


def _nonzero(values: torch.Tensor) -> torch.Tensor:
    if _np is not None:
        return torch.from_numpy(_np.nonzero(values.numpy())[0])
    return values.nonzero().reshape(-1)


class SpanDecode:
    """Decodes one span's stored bytes into `out` (a slot's views): planned once, run per copy; `dense`: ranked."""

    def __init__(self, code: SpanCode, stored: torch.Tensor, out: torch.Tensor, dense: bool | None = None):
        self.code, self.out = code, out
        padded = code.padded_elements
        with torch.inference_mode(False), torch.no_grad():
            self.raw = stored[: code.num_elements]
            self.fields = [(bits, shift, stored[at : at + padded * bits // 8]) for bits, shift, at in code.fields]
            header = stored[code.bases_offset : code.bases_offset + 8 * len(code.widths)].view(torch.int32)
            self.bases, self.counts = header[: len(code.widths)], header[len(code.widths) :]
            self.base0 = stored[code.bases_offset : code.bases_offset + 1]  # the low byte: uint8, for the add
            ends = list(code.tier_offsets[1:]) + [code.nbytes]
            self.tiers = [stored[at:end] for at, end in zip(code.tier_offsets, ends)]  # the later tiers, the literals
        self.dense = out.device.type != "cpu" if dense is None else dense
        self.chunk = CHUNK_ELEMENTS["cpu" if out.device.type == "cpu" else "other"]
        self.steps = code.steps(self.chunk)

    def run_(self) -> torch.Tensor:
        code, out = self.code, self.out
        scratch = _scratch_for(out.device, self.chunk)
        escapes = (_RankedEscapes if self.dense else _CountedEscapes)(self)
        width = code.widths[0]
        for first, blocks, block in self.steps:
            count = blocks * block
            real = min(count, code.num_elements - first)
            codes, part = scratch["codes"][:count], scratch["part"][:count]
            self._unpack_fields_(codes.view(blocks, block), part.view(blocks, block), first, blocks, block)
            escaped = None
            if escapes.possible:  # where tier 0's offset is all ones
                offsets = codes if code.dtype == "bfloat16" else torch.bitwise_and(codes, (1 << width) - 1, out=part)
                escaped = _all_ones(offsets, width, scratch["escaped"][:count])
            if code.dtype == "float16":  # the sign bit from the code's top to bit 7 of the high byte
                sign = torch.bitwise_right_shift(codes, width, out=part)
                codes.add_(sign.mul_(128 - (1 << width)))
            if escaped is None:
                codes.add_(escapes.base0)  # the coded byte
            else:
                escapes.apply_(codes, escaped)
            target = out[first : first + real]
            target.copy_(codes[:real]).bitwise_left_shift_(SHIFT[code.dtype])  # zero-extended, then into place
            raw = scratch["raw"][:real]
            if code.dtype == "bfloat16":
                raw.copy_(self.raw[first : first + real].view(torch.int8)).bitwise_and_(RAW_MASK16["bfloat16"])
            else:
                raw.copy_(self.raw[first : first + real])  # zero-extended: the low byte
            target.bitwise_or_(raw)
        return out

    def _unpack_fields_(self, codes: torch.Tensor, part: torch.Tensor, first: int, blocks: int, block: int) -> None:
        """Tier 0's codes of a step's blocks into `codes` (uint8, blocks x elements)."""
        for bits, shift, field in self.fields:
            length = block * bits // 8
            packed = field[first * bits // 8 : first * bits // 8 + blocks * length].view(blocks, length)
            target = codes if shift == 0 else part
            _unpack_planes_(packed, target, bits, shift, length)
            if shift:
                codes.bitwise_or_(target)


class _CountedEscapes:
    """The escapes of one run on the CPU: found and counted, each tier decoding only what reaches it."""

    def __init__(self, decode: SpanDecode):
        self.code, self.tiers = decode.code, decode.tiers
        self.bases = decode.bases.tolist()
        self.base0 = self.bases[0]
        self.counts = decode.counts.tolist()
        self.share = self.counts[0] / self.code.num_elements
        self.possible = self.counts[0] > 0
        self.cursors = [0] * (len(self.code.widths) + 1)  # codes of each tier read so far

    def apply_(self, codes: torch.Tensor, escaped: torch.Tensor) -> None:
        """Tier 0's codes (sign placed) to coded bytes: the base added, the escapes' values written."""
        positions = escapes_in(escaped, self.share)
        values = self.resolve(1, positions.numel())
        if self.code.dtype == "float16":
            values.bitwise_or_(codes.index_select(0, positions).bitwise_and_(0x80))  # the sign tier 0 kept
        codes.add_(self.base0).scatter_(0, positions, values)

    def resolve(self, tier: int, count: int) -> torch.Tensor:
        """The coded values (uint8, a tensor of their own) of the next `count` elements that reach `tier`."""
        start = self.cursors[tier]
        self.cursors[tier] += count
        if tier == len(self.code.widths):
            return self.tiers[-1][start : start + count].clone()  # the literals
        width = self.code.widths[tier]
        codes = unpack_codes(self.tiers[tier - 1], width, self.code.capacities[tier - 1], start, count)
        share = self.counts[tier] / max(1, self.counts[tier - 1])
        positions = escapes_in(_all_ones(codes, width, torch.empty_like(codes)), share)
        values = restore_values_(codes.add_(self.bases[tier]), self.bases, self.code.widths, tier)
        if positions.numel():
            values.scatter_(0, positions, self.resolve(tier + 1, positions.numel()))
        return values


class _RankedEscapes:
    """The escapes of one run on an accelerator: places are cumulative counts, kept on the device (no sync)."""

    def __init__(self, decode: SpanDecode):
        self.code, self.tiers = decode.code, decode.tiers
        self.bases = [decode.bases[k] for k in range(len(self.code.widths))]
        self.base0 = decode.base0
        self.possible = self.code.capacities[0] > 0
        self.cursors = [torch.zeros((), dtype=torch.int32, device=decode.out.device) for _ in range(len(self.code.widths) + 1)]

    def apply_(self, codes: torch.Tensor, escaped: torch.Tensor) -> None:
        values = self.resolve(1, escaped)
        if self.code.dtype == "float16":
            values.bitwise_or_(torch.bitwise_and(codes, 0x80))  # the sign tier 0 kept
        codes.add_(self.base0)
        torch.where(escaped, values, codes, out=codes)

    def resolve(self, tier: int, reach: torch.Tensor) -> torch.Tensor:
        """The coded value (uint8) of every element that reaches `tier` (any value elsewhere)."""
        code = self.code
        index = torch.cumsum(reach, 0, dtype=torch.int32).add_(self.cursors[tier] - 1)
        self.cursors[tier] = index[-1] + 1  # this tier's codes read so far: a device tensor, no sync
        capacity = code.capacities[tier - 1]
        if capacity == 0:  # nothing reaches this tier
            return torch.zeros(reach.shape, dtype=torch.uint8, device=reach.device)
        index.clamp_(0, capacity - 1)
        if tier == len(code.widths):
            return self.tiers[-1].index_select(0, index)  # the literals
        width = code.widths[tier]
        length = plane_bytes(capacity, width)  # code i: byte i % length, bit (i // length) * width
        packed = self.tiers[tier - 1].index_select(0, torch.remainder(index, length))
        shift = index.div_(length, rounding_mode="floor").mul_(width)
        codes = torch.bitwise_right_shift(packed.to(torch.int32), shift).bitwise_and_((1 << width) - 1).to(torch.uint8)
        reach_next = torch.eq(codes, (1 << width) - 1).logical_and_(reach)
        values = restore_values_(codes.add_(self.bases[tier]), self.bases, code.widths, tier)
        return torch.where(reach_next, self.resolve(tier + 1, reach_next), values)


def _all_ones(codes: torch.Tensor, width: int, out: torch.Tensor) -> torch.Tensor:
    """Where `codes` (uint8, each below 2^width) are all ones: bool, a view of `out` (uint8). By an add and a shift,
    which torch's CPU kernels vectorize (its comparisons of uint8: 0.7 ns an element, these 0.1)."""
    return torch.add(codes, 1, out=out).bitwise_right_shift_(width).view(torch.bool)


def _unpack_planes_(packed: torch.Tensor, target: torch.Tensor, bits: int, shift: int, length: int) -> None:
    """Code bits shift .. shift + bits - 1 from a planar field into `target` (uint8), the other bits zero."""
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


def decode(code: SpanCode, stored: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
    """The int16 elements coded in `stored` (a one-off `SpanDecode`, on the device `stored` is on)."""
    out = torch.empty(code.num_elements, dtype=torch.int16, device=stored.device)
    return SpanDecode(code, stored, out, dense).run_()
