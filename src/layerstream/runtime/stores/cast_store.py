"""The low-precision host store (`layer_options.<component>.storage_dtype`): fewer bytes over the link.

Each streamed block is kept in one contiguous host buffer, like the packed store, but the tensors diffusers'
layerwise casting would cast (`runtime.stores.cast_rule`) are stored in the storage dtype (float8: 1 byte) and the
rest byte for byte. A device slot holds the block's compute layout (the ordinary `BlockLayout`, which the
streamer binds) followed by a staging region for the stored bytes. One copy job moves the stored bytes into
the staging region (one host-to-device copy), then casts each stored span into its place in the compute layout
on the device (`copy_` with a dtype change: no allocation per block) and copies the rest as bytes.

`CastLayout` is the float8 form of a block (`contracts.StoredForm`); the other stores keep a float8 component's
blocks in it too: the disk tier (`host_budget_gb`) writes the stored bytes to its spill files and its host pool,
and the sharded store (`weight_transfer: "allgather"`) shards them and gathers them into the staging region. The result in
the compute layout is exactly what diffusers' casting hook produces resident: an fp8 -> bf16/fp16/fp32 upcast
is exact, so the output is bit-identical to the resident model with `enable_layerwise_casting`.

Lossy, once: staging rounds the cast weights to the storage dtype.
- `disable()` gives the model its weights back in their own dtype, with the rounded values.
- `state_dict()` gives the cast tensors in the storage dtype, as diffusers' layerwise casting does;
  `load_state_dict()` rounds the new values into it; buffers a block writes in forward are rounded the same way
  when they belong to a cast layer.
- Autograd through a cast block works: saved weights are upcast from the stored bytes (exact).
- LoRA on a cast block is refused (PEFT would create its adapters in the storage dtype).

Staging is a transaction: each block gets placeholders as soon as it is staged, but the store keeps its original
tensors until `commit_`, so `rollback_` gives the very same tensors back (exact, identity kept). Host memory
peaks at the original bytes plus the stored bytes during enable (1.5x a bf16 model for float8), never two full
copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.stores.cast_rule import cast_module_ids
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout, SpanMember, TensorBinder, align_up
from layerstream.runtime.packing.host_buffer import HostBufferBlock, page_aligned_empty
from layerstream.runtime.packing.stored_form import SlotUnpack
from layerstream.runtime.packing.upcast import Upcast, upcast_
from layerstream.runtime.stores.buffer_store import HostBufferStore
from layerstream.runtime.contracts import Job, Pinner

logger = logging.getLogger(__name__)

STORAGE_DTYPES: dict[str, torch.dtype] = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
"""The config's `storage_dtype` names and their torch dtypes."""

_CAST_ALIGN = 16  # stored cast spans start 16-byte aligned: vectorized cast kernels, little padding


@dataclass(frozen=True)
class Segment:
    """A byte range of the compute layout and where its bytes are in the stored buffer."""

    kind: Literal["raw", "cast"]
    """"raw": stored byte for byte; "cast": one storage span stored element for element in the storage dtype."""
    compute_start: int
    compute_nbytes: int
    stored_start: int
    stored_nbytes: int
    dtype: torch.dtype
    """The compute dtype of a cast span (uint8 for raw bytes)."""


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


class CastLayout:
    """How one block is stored: its segments, in compute-layout order (pure: reads the layout only). `layout`
    is the compute layout (`compute_layout_for`). The float8 `StoredForm`."""

    lossless = False  # the cast spans are rounded to the storage dtype
    stored_is_packed = False

    def __init__(self, layout: BlockLayout, cast_ids: frozenset[int], storage_dtype: torch.dtype):
        self.layout = layout
        self.storage_dtype = storage_dtype
        placements = layout.span_placements()
        span_dtype: list[torch.dtype | None] = [None] * len(placements)
        span_cast = [True] * len(placements)
        for e in layout.entries:
            i = e.span_index
            castable = is_cast_tensor(e.module, e.dtype, e.inner, cast_ids, storage_dtype)
            if not castable or span_dtype[i] not in (None, e.dtype):
                span_cast[i] = False  # a span is cast whole or not at all (its entries view one storage)
            span_dtype[i] = e.dtype
        self.span_segment: list[int] = []
        """For every storage span, the index of the segment holding it."""
        segments: list[Segment] = []
        offset = 0
        for i, (dst, length) in enumerate(placements):
            dtype = span_dtype[i]
            if span_cast[i] and dtype is not None and length % dtype.itemsize == 0 and dst % dtype.itemsize == 0:
                num_elements = length // dtype.itemsize
                start = align_up(offset, _CAST_ALIGN)
                nbytes = num_elements * storage_dtype.itemsize
                segments.append(Segment("cast", dst, length, start, nbytes, dtype))
                offset = start + nbytes
            elif segments and segments[-1].kind == "raw":
                last = segments[-1]  # neighbouring raw spans: one segment, padding included
                grown = dst + length - last.compute_start
                segments[-1] = Segment("raw", last.compute_start, grown, last.stored_start, grown, torch.uint8)
                offset = last.stored_start + grown
            else:
                # the same address residue as in the compute layout: host views keep every entry's alignment
                start = offset + (dst - offset) % ALIGN_BYTES
                segments.append(Segment("raw", dst, length, start, length, torch.uint8))
                offset = start + length
            self.span_segment.append(len(segments) - 1)
        self.segments = tuple(segments)
        self.stored_nbytes = max(align_up(offset), ALIGN_BYTES)
        """Bytes of the stored block (what moves over the link per transfer)."""
        self.cast_nbytes = sum(s.compute_nbytes for s in segments if s.kind == "cast")
        """Bytes of the compute layout that are cast from the storage dtype."""

    @property
    def slot_nbytes(self) -> int:
        """Compute layout, then the staging region for the stored bytes."""
        return self.layout.nbytes + self.stored_nbytes

    @property
    def stored_offset(self) -> int:
        return self.layout.nbytes  # the staging region follows the compute layout

    @property
    def signature(self) -> str:
        kinds = "".join("c" if s.kind == "cast" else "r" for s in self.segments)
        return f"{str(self.storage_dtype).removeprefix('torch.')} {self.stored_nbytes} segments {kinds}"

    def __repr__(self) -> str:
        return f"CastLayout({self.layout.path!r}, {self.stored_nbytes} bytes in {self.storage_dtype})"

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        """Write the block's stored bytes into `stored` (uint8, `stored_nbytes`) from the original tensors: cast
        spans rounded to the storage dtype, everything else copied as it is. With `files` and `reader`, spans
        that are unwritten views of a file mapping are read from the file first (one block's compute bytes at a
        time: the reader drops the pages it read). Returns the bytes read from files."""
        packed, from_files = None, 0
        if files is not None and reader is not None:
            packed = torch.empty(self.layout.nbytes, dtype=torch.uint8)
            from_files = self.layout.copy_sources_into(packed, files, reader)
        placements = self.layout.span_placements()
        for i, (dst, length) in enumerate(placements):
            segment = self.segments[self.span_segment[i]]
            source = self.layout.span_source(i) if packed is None else packed[dst : dst + length]
            if segment.kind == "cast":
                stored_view(stored, segment, self.storage_dtype).copy_(source.view(segment.dtype))
            else:
                at = segment.stored_start + dst - segment.compute_start
                stored[at : at + length].copy_(source)
        return from_files

    def fill_range_(self, out: torch.Tensor, start: int) -> None:
        """Stored bytes [start, start + out.numel()) into `out` (a rank's shard), made from the whole block's."""
        whole = torch.zeros(self.stored_nbytes, dtype=torch.uint8)
        self.fill_(whole)
        count = max(0, min(out.numel(), self.stored_nbytes - start))
        out[:count].copy_(whole[start : start + count])

    def slot_ops(self, slot_buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (compute view, stored view) pairs that fill a slot's compute layout from its staging region."""
        # like the layout's views: never inference tensors, never autograd history
        with torch.inference_mode(False), torch.no_grad():
            staging = slot_buffer[self.stored_offset : self.stored_offset + self.stored_nbytes]
            pairs = []
            for segment in self.slot_runs:
                compute = slot_buffer[segment.compute_start : segment.compute_start + segment.compute_nbytes]
                if segment.kind == "cast":
                    pairs.append((compute.view(segment.dtype), stored_view(staging, segment, self.storage_dtype)))
                else:
                    pairs.append((compute, staging[segment.stored_start : segment.stored_start + segment.stored_nbytes]))
        return pairs

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list[Upcast]:
        with torch.inference_mode(False), torch.no_grad():  # views that stay usable in and out of inference mode
            return [Upcast(destination, stored) for destination, stored in self.slot_ops(slot_buffer)]

    @property
    def slot_runs(self) -> tuple[Segment, ...]:
        """The segments as the slot unpacks them: neighbouring cast segments whose stored bytes lie as their compute
        bytes do (at the width ratio) are one cast, so a block's weights and biases are a few casts instead of one
        each (a launch each on a device, a lookup plan each on the CPU). The padding between them in the stored
        region is cast into the padding between them in the compute layout, which no tensor views."""
        runs: list[Segment] = []
        for segment in self.segments:
            last = runs[-1] if runs else None
            if (
                segment.kind == "cast" and last is not None and last.kind == "cast" and last.dtype == segment.dtype
                and segment.compute_start - last.compute_start
                == (segment.stored_start - last.stored_start) * segment.dtype.itemsize // self.storage_dtype.itemsize
            ):  # fmt: skip
                stored_nbytes = segment.stored_start + segment.stored_nbytes - last.stored_start
                runs[-1] = replace(
                    last, compute_nbytes=stored_nbytes * segment.dtype.itemsize // self.storage_dtype.itemsize, stored_nbytes=stored_nbytes
                )
            else:
                runs.append(segment)
        return tuple(runs)

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor:
        return self.compute_range(stored, 0, self.layout.nbytes)

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        return self.write_compute_range_(stored, slot_buffer, start, end, stored_start)

    def compute_range(self, stored: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of the block's compute layout, made on the host from `stored` (cast
        spans upcast: exact). Bytes no span covers are zero."""
        out = torch.zeros(nbytes, dtype=torch.uint8)
        end = start + nbytes
        for segment in self.segments:
            lo, hi = max(segment.compute_start, start), min(segment.compute_start + segment.compute_nbytes, end)
            if lo >= hi:
                continue
            if segment.kind == "cast":
                source = stored_view(stored, segment, self.storage_dtype)
                compute = upcast_(torch.empty(source.shape, dtype=segment.dtype, device=source.device), source).view(torch.uint8)
                out[lo - start : hi - start].copy_(compute[lo - segment.compute_start : hi - segment.compute_start])
            else:
                at = segment.stored_start - segment.compute_start
                out[lo - start : hi - start].copy_(stored[lo + at : hi + at])
        return out

    def write_compute_range_(self, stored: torch.Tensor, compute: torch.Tensor, start: int, end: int, stored_start: int = 0) -> int:
        """Store bytes [start, end) of a compute layout held in `compute` (a slot, or a host copy of the block's
        compute bytes) into `stored`, which holds stored bytes [stored_start, stored_start + stored.numel()) (the
        whole block, or a rank's shard); cast spans are rounded to the storage dtype. Returns the stored bytes
        written."""
        written = 0
        whole = stored_start == 0 and stored.numel() >= self.stored_nbytes
        for segment in self.segments:
            lo, hi = max(segment.compute_start, start), min(segment.compute_start + segment.compute_nbytes, end)
            if lo >= hi:
                continue
            if segment.kind == "cast":
                itemsize = segment.dtype.itemsize
                first = (lo - segment.compute_start) // itemsize
                last = -(-(hi - segment.compute_start) // itemsize)
                source = compute[segment.compute_start + first * itemsize : segment.compute_start + last * itemsize]
                if whole:
                    stored_view(stored, segment, self.storage_dtype)[first:last].copy_(source.view(segment.dtype))
                    written += (last - first) * self.storage_dtype.itemsize
                else:  # a shard: round the elements, keep the bytes of them that fall in it
                    rounded = source.view(segment.dtype).to(self.storage_dtype).view(torch.uint8).cpu()
                    written += _copy_window_(stored, stored_start, rounded, segment.stored_start + first * self.storage_dtype.itemsize)
            else:
                at = segment.stored_start - segment.compute_start
                if whole:
                    stored[lo + at : hi + at].copy_(compute[lo:hi])
                    written += hi - lo
                else:
                    written += _copy_window_(stored, stored_start, compute[lo:hi], lo + at)
        return written

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


def _copy_window_(stored: torch.Tensor, stored_start: int, data: torch.Tensor, at: int) -> int:
    """Copy the part of `data` (stored bytes from `at`) that falls in the window `stored` holds (from
    `stored_start`); returns the bytes copied."""
    lo, hi = max(at, stored_start), min(at + data.numel(), stored_start + stored.numel())
    if lo >= hi:
        return 0
    stored[lo - stored_start : hi - stored_start].copy_(data[lo - at : hi - at])
    return hi - lo


def stored_view(stored: torch.Tensor, segment: Segment, storage_dtype: torch.dtype) -> torch.Tensor:
    """A cast segment's elements in `stored` (a host buffer or a slot's staging region), in the storage dtype."""
    return stored[segment.stored_start : segment.stored_start + segment.stored_nbytes].view(storage_dtype)


class CastBlock(HostBufferBlock):
    """One block stored in low precision in a host buffer of this process (a `StoredBlock`)."""

    def __init__(self, cast_layout: CastLayout, binder: TensorBinder, buffer: torch.Tensor, originals: list[torch.Tensor]):
        self.cast_layout = cast_layout
        self.layout = cast_layout.layout
        self.binder = binder
        self.buffer = buffer
        self.originals: list[torch.Tensor] | None = originals
        """The block's own tensors until the store commits (the rollback gives them back exactly)."""
        self.unpack = SlotUnpack(cast_layout)

    def __repr__(self) -> str:
        return f"CastBlock({self.path!r}, {self.host_bytes} bytes in {self.storage_dtype}{', pinned' if self.pinned else ''})"

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.cast_layout.storage_dtype

    @property
    def link_bytes(self) -> int:
        return self.cast_layout.stored_nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        layout = self.cast_layout
        staging = slot_buffer[layout.stored_offset : layout.stored_offset + layout.stored_nbytes]
        source, unpack = self.buffer, self.unpack

        def job() -> int:
            staging.copy_(source, non_blocking=True)  # one host-to-device copy per block: the stored bytes
            unpack.run_(slot_buffer)  # then the casts into the compute layout, on the device
            return layout.stored_nbytes

        return job

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._check_held("backward through it")
        return self.cast_layout.compute_range(self.buffer, start, nbytes)

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._check_held("keep what its forward wrote")
        # a host-side copy from the device: it waits for the block's compute, which is what must finish first
        return self.cast_layout.write_compute_range_(self.buffer, slot_buffer, start, end)

    def host_tensors(self) -> list[torch.Tensor]:
        self._check_held("read its weights")
        return self.cast_layout.stored_tensors(self.buffer)

    def check_lora_(self) -> None:
        raise UnsupportedUseError(
            f"{self.path}: LoRA on a block stored with storage_dtype {str(self.storage_dtype).removeprefix('torch.')} "
            "is not supported (the adapters would be created in the storage dtype); load and fuse LoRA before "
            "enabling offload, or call handle.disable() first"
        )

    def _check_held(self, what: str) -> None:
        if self.buffer.numel() < self.cast_layout.stored_nbytes:
            raise UnsupportedUseError(
                f"{self.path}: offload was disabled since this block ran, so its host copy is gone; cannot {what}"
            )

    def forget_originals_(self) -> None:
        self.originals = None
        self.layout.forget_sources()

    def rollback_(self) -> None:
        """Give the block its original tensors back (before the commit: they were kept)."""
        assert self.originals is not None, f"{self.path}: rollback after commit"
        self.binder.bind_(self.originals)
        self.originals = None
        self.release_()

    def restore_(self, device: torch.device) -> None:
        """Real tensors in their own dtypes on `device` again (fresh storage per span; cast weights keep the
        values they were rounded to); the host buffer goes."""
        compute = self.cast_layout.compute_range(self.buffer, 0, self.layout.nbytes)
        self.binder.bind_(self.layout.separate_copies(compute, device))
        self.release_()

    def release_(self) -> None:
        self.unpack.clear_()
        self.release_buffer_()


class CastForms:
    """The float8 form (`CastLayout`) of each block of one component, computed once per layout; the stores that
    keep the component's blocks (local, disk tier, sharded) share it."""

    def __init__(self, model: nn.Module, storage_dtype: torch.dtype):
        self.storage_dtype = storage_dtype
        self._cast_ids = cast_module_ids(model)
        self._known: dict[int, tuple[BlockLayout, CastLayout]] = {}  # id(layout) -> (layout, its cast layout)

    def form(self, layout: BlockLayout) -> CastLayout:
        known = self._known.get(id(layout))
        if known is not None and known[0] is layout:
            return known[1]
        compute = compute_layout_for(layout, self._cast_ids, self.storage_dtype)
        cast_layout = CastLayout(compute, self._cast_ids, self.storage_dtype)
        self._known[id(layout)] = (layout, cast_layout)
        return cast_layout


class CastHostStore(HostBufferStore):
    """`HostStore` keeping one component's blocks in low precision in this process's memory."""

    kind = "cast"

    def __init__(self, model: nn.Module, storage_dtype: torch.dtype, forms: CastForms | None = None):
        self.storage_dtype = storage_dtype
        self.forms = forms if forms is not None else CastForms(model, storage_dtype)
        super().__init__()
        self.blocks: dict[str, CastBlock] = {}

    def __repr__(self) -> str:
        return f"CastHostStore({self.storage_dtype}, {len(self.blocks)} blocks, {sum(b.host_bytes for b in self.blocks.values())} bytes)"

    def cast_layout(self, layout: BlockLayout) -> CastLayout:
        """How `layout`'s block is stored (computed once per layout)."""
        return self.forms.form(layout)

    def stored_form(self, layout: BlockLayout) -> CastLayout:
        return self.forms.form(layout)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.cast_layout(layout).slot_nbytes  # the compute layout and a staging region for the stored bytes

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.cast_layout(layout).stored_nbytes  # what the host keeps: the stored (float8) bytes

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> CastBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        cast_layout = self.cast_layout(layout)
        compute = cast_layout.layout
        buffer = page_aligned_empty(cast_layout.stored_nbytes, zeroed=True)  # its pages its own: it can be page-locked
        cast_layout.fill_(buffer)
        originals = [current_tensor(e.module, e.name, e.is_param) for e in compute.entries]
        block = CastBlock(cast_layout, TensorBinder(compute, device), buffer, originals)
        if pin is not None:
            self._pinning.submit(block, pin)  # page-locking it overlaps with casting the next block
        block.binder.evict_()  # the originals stay referenced by the block until commit_
        self.blocks[layout.path] = block
        return block

    def commit_(self) -> None:
        self._pinning.finish(raise_errors=True)  # a failed pin still finds the originals for the rollback
        for block in self.blocks.values():
            block.forget_originals_()  # from here on the stored bytes are the only copy

    def rollback_(self) -> None:
        self._pinning.finish(raise_errors=False)
        for path in list(self.blocks):
            self.blocks.pop(path).rollback_()


def current_tensor(module: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    """The tensor the binder would replace: a parameter's `.data` (the Parameter object stays), or the buffer."""
    return module._parameters[name].data if is_param else module._buffers[name]
