"""The float8 form of a block (`layer_options.<component>.storage_dtype`): fewer bytes over the link.

The tensors diffusers' layerwise casting would cast (`forms.cast_rule`) are stored in the storage dtype (1 byte)
and the rest byte for byte. A slot holds the compute layout, then a staging region for the stored bytes; each
stored span is cast into its place on the device (`copy_` with a dtype change: no allocation per block). An
fp8 -> bf16/fp16/fp32 upcast is exact, so the output is bit-identical to the resident model with
`enable_layerwise_casting`. Lossy once, when staging rounds the weights: `disable()`, `state_dict()` and
`load_state_dict()` see the rounded values (docs/storage.md); LoRA on a cast block is refused (PEFT would make
float8 adapters). A store keeps the original tensors until it commits, so that a rollback gives them back.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from layerstream.runtime.forms.cast_rule import cast_module_ids
from layerstream.runtime.forms.segments import FormsByLayout, Segment, SegmentedForm
from layerstream.runtime.forms.slot import stored_region
from layerstream.runtime.packing.layout import BlockLayout, SpanMember
from layerstream.runtime.packing.upcast import Upcast, upcast_

STORAGE_DTYPES: dict[str, torch.dtype] = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
"""The config's `storage_dtype` names and their torch dtypes."""


def is_cast_tensor(module: nn.Module, dtype: torch.dtype, inner: tuple, cast_ids: frozenset[int], storage_dtype: torch.dtype) -> bool:
    """Whether a block tensor is stored in `storage_dtype` (a tensor of a cast layer, floating point, wider)."""
    return (
        id(module) in cast_ids
        and not inner  # a quantized weight's inner tensors (torchao) keep their dtype
        and dtype.is_floating_point
        and dtype.itemsize > storage_dtype.itemsize
    )


def compute_layout_for(layout: BlockLayout, cast_ids: frozenset[int], storage_dtype: torch.dtype) -> BlockLayout:
    """The layout a slot's compute part has: spans that are cast sit at residue 0, where diffusers' casting hook
    puts them resident (every forward upcasts into a fresh allocation), the rest at their resident residue."""

    def fresh(members: list[SpanMember]) -> bool:
        dtypes = {m.tensor.dtype for m in members}
        return len(dtypes) == 1 and all(is_cast_tensor(m.module, m.tensor.dtype, m.inner, cast_ids, storage_dtype) for m in members)

    return layout.relocated(fresh)


class Float8Form(SegmentedForm):
    """How one block is stored in float8: its segments, in compute-layout order (pure: reads the layout only).
    `layout` is the compute layout (`compute_layout_for`)."""

    lossless = False  # the cast spans are rounded to the storage dtype
    coded = False

    def __init__(self, layout: BlockLayout, cast_ids: frozenset[int], storage_dtype: torch.dtype):
        self.storage_dtype = storage_dtype
        num_spans = len(layout.span_placements())
        self._span_dtype: list[torch.dtype | None] = [None] * num_spans
        self._span_cast = [True] * num_spans
        for e in layout.entries:
            i = e.span_index
            castable = is_cast_tensor(e.module, e.dtype, e.inner, cast_ids, storage_dtype)
            if not castable or self._span_dtype[i] not in (None, e.dtype):
                self._span_cast[i] = False  # a span is cast whole or not at all (its entries view one storage)
            self._span_dtype[i] = e.dtype
        super().__init__(layout)

    def _kept(self, span: int, dst: int, length: int):
        dtype = self._span_dtype[span]
        if self._span_cast[span] and dtype is not None and length % dtype.itemsize == 0 and dst % dtype.itemsize == 0:
            return "cast", length // dtype.itemsize * self.storage_dtype.itemsize, dtype, None
        return None

    @property
    def signature(self) -> str:
        kinds = "".join("c" if s.kind == "cast" else "r" for s in self.segments)
        return f"{str(self.storage_dtype).removeprefix('torch.')} {self.stored_nbytes} segments {kinds}"

    def __repr__(self) -> str:
        return f"Float8Form({self.layout.path!r}, {self.stored_nbytes} bytes in {self.storage_dtype})"

    def _store_span_(self, span: int, segment: Segment, source: torch.Tensor, stored: torch.Tensor) -> None:
        stored_view(stored, segment, self.storage_dtype).copy_(source.view(segment.dtype))  # rounded

    def _span_compute_bytes(self, segment: Segment, stored: torch.Tensor) -> torch.Tensor:
        source = stored_view(stored, segment, self.storage_dtype)
        return upcast_(torch.empty(source.shape, dtype=segment.dtype, device=source.device), source).view(torch.uint8)

    def _stored_bytes_of(self, segment: Segment, compute: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        itemsize = segment.dtype.itemsize
        first = (lo - segment.compute_start) // itemsize  # whole elements: every one the range touches
        last = -(-(hi - segment.compute_start) // itemsize)
        source = compute[segment.compute_start + first * itemsize : segment.compute_start + last * itemsize]
        rounded = source.view(segment.dtype).to(self.storage_dtype).view(torch.uint8)
        return rounded, segment.stored_start + first * self.storage_dtype.itemsize

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list[Upcast]:
        """One cast per run of cast segments (`slot_runs`), one byte copy per raw segment."""
        staging = stored_region(self, slot_buffer)
        ops = []
        for s in self.slot_runs:
            compute = slot_buffer[s.compute_start : s.compute_start + s.compute_nbytes]
            if s.kind == "cast":
                ops.append(Upcast(compute.view(s.dtype), stored_view(staging, s, self.storage_dtype)))
            else:
                ops.append(Upcast(compute, staging[s.stored_start : s.stored_start + s.stored_nbytes]))
        return ops

    @property
    def slot_runs(self) -> tuple[Segment, ...]:
        """The segments as the slot unpacks them: neighbouring cast segments whose stored bytes lie as their compute
        bytes do (at the width ratio) are one cast, so a block's weights and biases are a few casts instead of one
        each (a launch each on a device, a lookup plan each on the CPU). The padding between them in the stored
        region is cast into the padding between them in the compute layout, which no tensor views."""
        runs: list[Segment] = []
        for segment in self.segments:
            last = runs[-1] if runs else None
            ratio = segment.dtype.itemsize // self.storage_dtype.itemsize  # compute bytes per stored byte
            if (
                segment.kind == "cast" and last is not None and last.kind == "cast" and last.dtype == segment.dtype
                and segment.compute_start - last.compute_start == (segment.stored_start - last.stored_start) * ratio
            ):  # fmt: skip
                stored_nbytes = segment.stored_start + segment.stored_nbytes - last.stored_start
                runs[-1] = replace(last, compute_nbytes=stored_nbytes * ratio, stored_nbytes=stored_nbytes)
            else:
                runs.append(segment)
        return tuple(runs)

    def stored_tensors(self, stored: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per layout entry viewing `stored`: cast entries in the storage dtype, the rest as they are."""
        out = []
        typed: dict[torch.dtype, torch.Tensor] = {}
        for e in self.layout.entries:
            segment = self.segments[self.span_segment[e.span_index]]
            if segment.kind == "cast":
                dtype = self.storage_dtype
                relative = e.element_offset - segment.compute_start // e.dtype.itemsize
                offset = segment.stored_start // dtype.itemsize + relative
            else:
                dtype = e.dtype
                offset = (segment.stored_start - segment.compute_start) // dtype.itemsize + e.element_offset
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = stored.view(dtype)
            out.append(torch.as_strided(base, e.shape, e.stride, base.storage_offset() + offset))  # `stored` may be a slice
        return out


def stored_view(stored: torch.Tensor, segment: Segment, storage_dtype: torch.dtype) -> torch.Tensor:
    """A cast segment's elements in `stored` (a host buffer or a slot's staging region), in the storage dtype."""
    return stored[segment.stored_start : segment.stored_start + segment.stored_nbytes].view(storage_dtype)


def float8_forms(model: nn.Module, storage_dtype: torch.dtype) -> FormsByLayout:
    """The float8 form of each block of `model` (a component), made once per layout."""
    cast_ids = cast_module_ids(model)
    return FormsByLayout(lambda layout: Float8Form(compute_layout_for(layout, cast_ids, storage_dtype), cast_ids, storage_dtype))
