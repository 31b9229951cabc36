"""What the forms that unpack in the slot share (float8, lossless): a block's spans laid out as segments of
stored bytes, each kept byte for byte (raw) or in the form's own way (cast to float8, coded), and the moves
between the stored bytes and the compute layout that follow from them. A slot holds the compute layout, then a
staging region for the stored bytes; the form's `unpack_ops` fill the one from the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout, align_up
from layerstream.runtime.packing.lossless_code import SpanCode

_KEPT_ALIGN = 16  # cast and coded spans start 16-byte aligned: vectorized kernels, little padding


@dataclass(frozen=True)
class Segment:
    """A byte range of the compute layout and where its bytes are in the stored block."""

    kind: Literal["raw", "cast", "coded"]
    """"raw": stored byte for byte; "cast": one span stored element for element in the storage dtype; "coded":
    one span in the lossless code."""
    compute_start: int
    compute_nbytes: int
    stored_start: int
    stored_nbytes: int
    dtype: torch.dtype = torch.uint8
    """The compute dtype of a cast span (uint8 otherwise)."""
    code: SpanCode | None = None
    """The code of a coded span (None otherwise)."""


class SegmentedForm:
    """The part of a `contracts.StoredForm` that follows from its segments; a form says how it keeps a span (`_kept`),
    stores one (`_store_span_`, `_stored_bytes_of`) and gives its compute bytes back (`_span_compute_bytes`)."""

    lossless: bool
    coded: bool
    stored_is_packed = False  # the stored bytes are not the packed layout: a checkpoint's bytes cannot serve them

    def __init__(self, layout: BlockLayout):
        self.layout = layout
        segments: list[Segment] = []
        self.span_segment: list[int] = []
        """For every storage span, the index of the segment holding it."""
        offset = 0
        for i, (dst, length) in enumerate(layout.span_placements()):
            how = self._kept(i, dst, length)
            if how is not None:
                kind, nbytes, dtype, code = how
                start = align_up(offset, _KEPT_ALIGN)
                segments.append(Segment(kind, dst, length, start, nbytes, dtype, code))
                offset = start + nbytes
            elif segments and segments[-1].kind == "raw":
                last = segments[-1]  # neighbouring raw spans: one segment, padding included
                grown = dst + length - last.compute_start
                segments[-1] = Segment("raw", last.compute_start, grown, last.stored_start, grown)
                offset = last.stored_start + grown
            else:
                # the same address residue as in the compute layout: host views keep every entry's alignment
                start = offset + (dst - offset) % ALIGN_BYTES
                segments.append(Segment("raw", dst, length, start, length))
                offset = start + length
            self.span_segment.append(len(segments) - 1)
        self.segments = tuple(segments)
        self.stored_nbytes = max(align_up(offset), ALIGN_BYTES)
        """Bytes of the stored block (what moves over the link per transfer)."""

    @property
    def stored_offset(self) -> int:
        return self.layout.nbytes  # the staging region follows the compute layout

    @property
    def slot_nbytes(self) -> int:
        """The compute layout, then the staging region for the stored bytes."""
        return self.layout.nbytes + self.stored_nbytes

    def _kept(self, span: int, dst: int, length: int) -> tuple[Literal["cast", "coded"], int, torch.dtype, SpanCode | None] | None:
        """How the form keeps a span (kind, stored bytes, compute dtype, code), or None: raw."""
        raise NotImplementedError

    def _store_span_(self, span: int, segment: Segment, source: torch.Tensor, stored: torch.Tensor) -> None:
        raise NotImplementedError

    def _span_compute_bytes(self, segment: Segment, stored: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _stored_bytes_of(self, segment: Segment, compute: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """The stored bytes that hold compute bytes [lo, hi) of a kept span, made from `compute`, and where they
        start in the stored block."""
        raise NotImplementedError

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        """Write the block's stored bytes into `stored` from the original tensors. With `files` and `reader`,
        spans that are unwritten views of a file mapping are read from the file first (one block's compute bytes
        at a time: the reader drops the pages it read). Returns the bytes read from files."""
        packed, from_files = None, 0
        if files is not None and reader is not None:
            packed = torch.empty(self.layout.nbytes, dtype=torch.uint8)
            from_files = self.layout.copy_sources_into(packed, files, reader)
        for i, (dst, length) in enumerate(self.layout.span_placements()):
            segment = self.segments[self.span_segment[i]]
            source = self.layout.span_source(i) if packed is None else packed[dst : dst + length]
            if segment.kind == "raw":
                at = segment.stored_start + dst - segment.compute_start
                stored[at : at + length].copy_(source)
            else:
                self._store_span_(i, segment, source, stored)
        return from_files

    def fill_range_(self, out: torch.Tensor, start: int) -> None:
        """Stored bytes [start, start + out.numel()) into `out` (a rank's shard), made from the whole block's."""
        whole = torch.zeros(self.stored_nbytes, dtype=torch.uint8)
        self.fill_(whole)
        count = max(0, min(out.numel(), self.stored_nbytes - start))
        out[:count].copy_(whole[start : start + count])

    def _overlapping(self, segments: tuple[Segment, ...], start: int, end: int) -> Iterator[tuple[Segment, int, int]]:
        for s in segments:
            lo, hi = max(s.compute_start, start), min(s.compute_start + s.compute_nbytes, end)
            if lo < hi:
                yield s, lo, hi

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor:
        return self.compute_range(stored, 0, self.layout.nbytes)

    def compute_range(self, stored: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of the block's compute layout, made on the host from `stored` (the whole
        stored block; cast spans upcast, coded spans decoded: exact). Bytes no span covers are zero."""
        out = torch.zeros(nbytes, dtype=torch.uint8)
        for s, lo, hi in self._overlapping(self.segments, start, start + nbytes):
            if s.kind == "raw":
                at = s.stored_start - s.compute_start
                out[lo - start : hi - start].copy_(stored[lo + at : hi + at])
            else:
                values = self._span_compute_bytes(s, stored)
                out[lo - start : hi - start].copy_(values[lo - s.compute_start : hi - s.compute_start])
        return out

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        """Store bytes [start, end) of a compute layout held in `slot_buffer` (a slot, or host compute bytes) into
        `stored`, which holds stored bytes [stored_start, stored_start + stored.numel()) (the whole block, or a rank's
        shard): cast spans rounded to the storage dtype, coded spans coded again whole. Every span is made before
        anything is written (a span whose values do not fit its code raises first). Returns the stored bytes written."""
        writes: list[tuple[torch.Tensor, int]] = []  # (stored bytes, where they start in the stored block)
        for s, lo, hi in self._overlapping(self.segments, start, end):
            if s.kind == "raw":
                writes.append((slot_buffer[lo:hi], s.stored_start + lo - s.compute_start))
            else:
                writes.append(self._stored_bytes_of(s, slot_buffer, lo, hi))
        return sum(copy_window_(stored, stored_start, data, at) for data, at in writes)


def copy_window_(stored: torch.Tensor, stored_start: int, data: torch.Tensor, at: int) -> int:
    """Copy the part of `data` (stored bytes from `at`) that falls in the window `stored` holds (from
    `stored_start`); returns the bytes copied."""
    lo, hi = max(at, stored_start), min(at + data.numel(), stored_start + stored.numel())
    if lo >= hi:
        return 0
    stored[lo - stored_start : hi - stored_start].copy_(data[lo - at : hi - at])
    return hi - lo


class FormsByLayout:
    """The form of each block of one component, made once per layout; the stores that keep the component's
    blocks (local, disk tier, sharded) share it. A block the form would keep all raw (nothing to cast or code: an
    fp8_scaled block under float8, a float32 one under lossless) is kept packed, its slot the compute layout alone
    instead of that plus a staging copy of the same bytes."""

    def __init__(self, make: Callable[[BlockLayout], SegmentedForm]):
        self._make = make
        self._known: dict[int, tuple[BlockLayout, SegmentedForm | PackedForm]] = {}  # id(layout) -> (layout, its form)

    def form(self, layout: BlockLayout) -> SegmentedForm | PackedForm:
        known = self._known.get(id(layout))
        if known is not None and known[0] is layout:
            return known[1]
        form: SegmentedForm | PackedForm = self._make(layout)
        if all(s.kind == "raw" for s in form.segments):
            form = PackedForm(layout)
        self._known[id(layout)] = (layout, form)
        return form
