"""The lossless form of a block (`layer_options.<component>.storage_dtype: "lossless"`): about 0.68x the bytes of
a trained bfloat16 block over the link and in host memory, and the very same bits in the slot.

Every bfloat16 and float16 parameter span of at least `MIN_CODED_BYTES` is kept in `runtime.packing.lossless_code`'s
code (the rest byte for byte); the copy decodes each coded span from the slot's staging region into the compute
layout, in the copy's stream, before the slot is ready. The code is exact by construction. Sizes come from the
block's values, read once (a meta skeleton is priced at `lossless_code.priced_fraction()`); new values
(`load_state_dict`, LoRA fusing, a write-back) keep each tensor's escape capacity, and values that need more are
refused with `UnsupportedUseError` before the store changes (docs/storage.md).
"""

from __future__ import annotations

import torch

from layerstream.errors import OffloadError, UnsupportedUseError
from layerstream.runtime.forms.segments import FormsByLayout, Segment, SegmentedForm
from layerstream.runtime.forms.slot import SlotOp, stored_region
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.packing.lossless_code import (
    CODED_DTYPES,
    _CodeOverflowError,
    SpanDecode,
    count_coded,
    decode,
    encode_into_,
    estimated_code,
    plan_code_from_counts,
)
from layerstream.runtime.packing.upcast import Upcast

LOSSLESS = "lossless"
"""The config's `storage_dtype` value of this form."""
MIN_CODED_BYTES = 4096
"""Smaller spans stay raw: their header and escape slack would eat what coding them saves."""


def _coded_span_dtype(layout: BlockLayout) -> list[str | None]:
    """Per storage span: its coded dtype name where every entry viewing it is a bfloat16 or float16 parameter (the
    same dtype), else None (kept raw)."""
    placements = layout.span_placements()
    out: list[str | None] = [None] * len(placements)
    ok = [True] * len(placements)
    for e in layout.entries:
        i = e.span_index
        name = CODED_DTYPES.get(e.dtype)
        if name is None or not e.is_param or e.inner or out[i] not in (None, name):
            ok[i] = False  # buffers stay raw: a block may write them in its forward (write-back keeps sizes)
        out[i] = name
    return [name if ok[i] else None for i, name in enumerate(out)]


class LosslessForm(SegmentedForm):
    """How one block is stored losslessly: its segments, in compute-layout order. Made from the block's values
    (see the module docstring); the layout is the block's own."""

    lossless = True
    coded = True

    def __init__(self, layout: BlockLayout):
        self._counts: dict[int, torch.Tensor] = {}
        """Each coded span's coded-byte counts from planning, for its first fill (not counted twice at enable)."""
        self._names = _coded_span_dtype(layout)
        super().__init__(layout)

    def _kept(self, span: int, dst: int, length: int):
        dtype = self._names[span]
        if dtype is None or length < MIN_CODED_BYTES or dst % 2 or length % 2:
            return None
        source = self.layout.span_source(span)
        if source.device.type == "meta":
            code = estimated_code(length // 2, dtype)  # a skeleton: priced, never filled
        else:
            counts = self._counts[span] = count_coded(source.cpu().view(torch.int16), dtype)
            code = plan_code_from_counts(counts, length // 2, dtype)
        return ("coded", code.nbytes, torch.uint8, code) if code is not None else None

    def __repr__(self) -> str:
        return f"LosslessForm({self.layout.path!r}, {self.stored_nbytes} of {self.layout.nbytes} bytes)"

    @property
    def signature(self) -> str:
        codes = ",".join(s.code.signature if s.code is not None else "r" for s in self.segments)
        return f"lossless {self.stored_nbytes} segments {codes}"

    def _store_span_(self, span: int, segment: Segment, source: torch.Tensor, stored: torch.Tensor) -> None:
        region = stored[segment.stored_start : segment.stored_start + segment.stored_nbytes]
        try:
            # the planning's counts: the window they give codes any values exactly (the capacity is checked)
            encode_into_(segment.code, source.cpu().view(torch.int16), region, self._counts.pop(span, None))
        except _CodeOverflowError as e:  # the values changed since the form was made from them
            raise OffloadError(f"{self.layout.path}: its weights changed while offload was being enabled ({e})") from e

    def _span_compute_bytes(self, segment: Segment, stored: torch.Tensor) -> torch.Tensor:
        region = stored[segment.stored_start : segment.stored_start + segment.stored_nbytes].cpu()
        return decode(segment.code, region).view(torch.uint8)

    def _stored_bytes_of(self, segment: Segment, compute: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        values = compute[segment.compute_start : segment.compute_start + segment.compute_nbytes].cpu().view(torch.int16)
        coded = torch.zeros(segment.stored_nbytes, dtype=torch.uint8)
        try:
            encode_into_(segment.code, values, coded)  # the whole span, coded again
        except _CodeOverflowError as e:
            raise UnsupportedUseError(
                f"{self.layout.path}: its new values do not fit the lossless code it was stored in at enable ({e}); "
                "the store keeps its previous values. Call handle.disable(), change the weights, and enable again"
            ) from e
        return coded, segment.stored_start

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list[SlotOp]:
        """One decode per coded span, one byte copy per raw segment."""
        staging = stored_region(self, slot_buffer)
        ops: list[SlotOp] = []
        for s in self.segments:
            compute = slot_buffer[s.compute_start : s.compute_start + s.compute_nbytes]
            stored = staging[s.stored_start : s.stored_start + s.stored_nbytes]
            ops.append(SpanDecode(s.code, stored, compute.view(torch.int16)) if s.kind == "coded" else Upcast(compute, stored))
        return ops


def lossless_forms() -> FormsByLayout:
    """The lossless form of each block of a component, made once per layout."""
    return FormsByLayout(LosslessForm)
