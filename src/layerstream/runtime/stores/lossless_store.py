"""The lossless compressed host store (`layer_options.<component>.storage_dtype: "lossless"`): about 0.75x the
bytes of a bfloat16 block over the link and in host memory, and the very same bits in the slot.

Every bfloat16 and float16 parameter span of a streamed block of at least `MIN_CODED_BYTES` is kept in the
code of `runtime.packing.lossless_code` (the rest, buffers included, byte for byte); a device slot holds the
block's compute layout (its ordinary `BlockLayout`, at its resident residues) followed by a staging region for the
stored bytes. One copy job moves the stored bytes into the staging region, then decodes each coded span into its
place in the compute layout, on the device and in the copy's stream (on the copy thread on a CPU device), before
the slot is marked ready. The code is exact by construction (every bit of every element is either kept or looked
up), so outputs are bit-identical to streaming the same weights uncompressed.

`LosslessForm` is a block's lossless form (`contracts.StoredForm`); the other stores keep a lossless component's
blocks in it as they keep a float8 one's: the disk tier writes its stored bytes to spill files (a checkpoint-backed
block is coded once at enable: the disk reads shrink too) and the sharded store shards them. The form's sizes
come from the block's values (how many escapes each tensor needs), read once when the form is made; a skeleton on
the meta device is priced at `ESTIMATED_CODED_FRACTION`.

Changing a block's values keeps its sizes: `load_state_dict`, LoRA fusing and a write-back code the new values
again with each tensor's escape capacity (a little more than it needed at enable). Values that need more escapes
are refused with `UnsupportedUseError` before the store changes. `state_dict()` gives decoded copies (an in-place
write into them does not reach the store; `load_state_dict` does); `disable()` gives the original bits back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from layerstream.errors import OffloadError, UnsupportedUseError
from layerstream.runtime.contracts import Job, Pinner, StoreStats
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.host_buffer import HostBufferBlock, page_aligned_empty
from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout, TensorBinder, align_up
from layerstream.runtime.packing.lossless_code import (
    CODED_DTYPES,
    _CodeOverflowError,
    SpanCode,
    SpanDecode,
    count_coded,
    decode,
    encode_into_,
    estimated_code,
    plan_code_from_counts,
)
from layerstream.runtime.packing.upcast import Upcast
from layerstream.runtime.stores.buffer_store import HostBufferStore
from layerstream.runtime.stores.cast_store import current_tensor
from layerstream.runtime.packing.stored_form import SlotUnpack

logger = logging.getLogger(__name__)

LOSSLESS = "lossless"
"""The config's `storage_dtype` value of this form."""
MIN_CODED_BYTES = 4096
"""Smaller spans stay raw: their header and escape slack would eat what coding them saves."""


@dataclass(frozen=True)
class LosslessSegment:
    """A byte range of the compute layout and where its bytes are in the stored block."""

    kind: Literal["raw", "coded"]
    compute_start: int
    compute_nbytes: int
    stored_start: int
    stored_nbytes: int
    code: SpanCode | None = None
    """The code of a coded span (None for raw bytes)."""


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


class LosslessForm:
    """How one block is stored losslessly: its segments, in compute-layout order (the lossless `StoredForm`).
    Made from the block's values (see the module docstring); the layout is the block's own."""

    lossless = True
    stored_is_packed = False  # the stored bytes are coded: a checkpoint's bytes cannot serve them

    def __init__(self, layout: BlockLayout):
        self.layout = layout
        self._counts: dict[int, torch.Tensor] = {}
        """Each coded span's coded-byte counts from planning, for its first fill (not counted twice at enable)."""
        names = _coded_span_dtype(layout)
        segments: list[LosslessSegment] = []
        self.span_segment: list[int] = []
        offset = 0
        for i, (dst, length) in enumerate(layout.span_placements()):
            code = None
            if names[i] is not None and length >= MIN_CODED_BYTES and dst % 2 == 0 and length % 2 == 0:
                code = self._plan(i, names[i], length // 2)
            if code is not None:
                start = align_up(offset, 16)
                segments.append(LosslessSegment("coded", dst, length, start, code.nbytes, code))
                offset = start + code.nbytes
            elif segments and segments[-1].kind == "raw":
                last = segments[-1]  # neighbouring raw spans: one segment, padding included
                grown = dst + length - last.compute_start
                segments[-1] = LosslessSegment("raw", last.compute_start, grown, last.stored_start, grown)
                offset = last.stored_start + grown
            else:
                start = offset + (dst - offset) % ALIGN_BYTES  # the compute layout's residue: host views stay aligned
                segments.append(LosslessSegment("raw", dst, length, start, length))
                offset = start + length
            self.span_segment.append(len(segments) - 1)
        self.segments = tuple(segments)
        self.stored_nbytes = max(align_up(offset), ALIGN_BYTES)
        """Bytes of the stored block (what moves over the link per transfer)."""
        self.coded_nbytes = sum(s.compute_nbytes for s in segments if s.kind == "coded")
        """Bytes of the compute layout that are coded."""

    def _plan(self, span: int, dtype: str, num_elements: int) -> SpanCode | None:
        source = self.layout.span_source(span)
        if source.device.type == "meta":
            return estimated_code(num_elements, dtype)  # a skeleton: priced, never filled
        counts = self._counts[span] = count_coded(source.cpu().view(torch.int16), dtype)
        return plan_code_from_counts(counts, num_elements, dtype)

    def __repr__(self) -> str:
        return f"LosslessForm({self.layout.path!r}, {self.stored_nbytes} of {self.layout.nbytes} bytes)"

    @property
    def slot_nbytes(self) -> int:
        """The compute layout, then the staging region for the stored bytes."""
        return self.layout.nbytes + self.stored_nbytes

    @property
    def stored_offset(self) -> int:
        return self.layout.nbytes  # the staging region follows the compute layout

    @property
    def signature(self) -> str:
        codes = ",".join(f"{s.code.width}/{s.code.capacity}" if s.code is not None else "r" for s in self.segments)
        return f"lossless {self.stored_nbytes} segments {codes}"

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        """Write the block's stored bytes into `stored` from the original tensors (spans that are unwritten views
        of a file mapping are read from the file first, one block at a time). Returns the bytes read from files."""
        packed, from_files = None, 0
        if files is not None and reader is not None:
            packed = torch.empty(self.layout.nbytes, dtype=torch.uint8)
            from_files = self.layout.copy_sources_into(packed, files, reader)
        for i, (dst, length) in enumerate(self.layout.span_placements()):
            segment = self.segments[self.span_segment[i]]
            source = self.layout.span_source(i) if packed is None else packed[dst : dst + length]
            if segment.kind == "coded":
                region = stored[segment.stored_start : segment.stored_start + segment.stored_nbytes]
                try:
                    # the planning's counts: the window they give codes any values exactly (the capacity is checked)
                    encode_into_(segment.code, source.cpu().view(torch.int16), region, self._counts.pop(i, None))
                except _CodeOverflowError as e:  # the values changed since the form was made from them
                    raise OffloadError(f"{self.layout.path}: its weights changed while offload was being enabled ({e})") from e
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
        """The raw segments' (compute view, stored view) copies in a slot (the coded ones decode: `unpack_ops`)."""
        staging = slot_buffer[self.stored_offset : self.stored_offset + self.stored_nbytes]
        return [
            (slot_buffer[s.compute_start : s.compute_start + s.compute_nbytes], staging[s.stored_start : s.stored_start + s.stored_nbytes])
            for s in self.segments
            if s.kind == "raw"
        ]

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list:
        """What turns the stored bytes in a slot's staging region into the compute layout: one decode per coded
        span, one byte copy per raw segment."""
        with torch.inference_mode(False), torch.no_grad():  # views that stay usable in and out of inference mode
            staging = slot_buffer[self.stored_offset : self.stored_offset + self.stored_nbytes]
            ops: list = []
            for s in self.segments:
                compute = slot_buffer[s.compute_start : s.compute_start + s.compute_nbytes]
                stored = staging[s.stored_start : s.stored_start + s.stored_nbytes]
                ops.append(SpanDecode(s.code, stored, compute.view(torch.int16)) if s.kind == "coded" else Upcast(compute, stored))
        return ops

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor:
        return self.compute_range(stored, 0, self.layout.nbytes)

    def compute_range(self, stored: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of the block's compute layout, decoded on the host from `stored` (the
        whole stored block). Bytes no span covers are zero."""
        out = torch.zeros(nbytes, dtype=torch.uint8)
        end = start + nbytes
        for s in self.segments:
            lo, hi = max(s.compute_start, start), min(s.compute_start + s.compute_nbytes, end)
            if lo >= hi:
                continue
            if s.kind == "coded":
                region = stored[s.stored_start : s.stored_start + s.stored_nbytes].cpu()
                values = decode(s.code, region).view(torch.uint8)
                out[lo - start : hi - start].copy_(values[lo - s.compute_start : hi - s.compute_start])
            else:
                at = s.stored_start - s.compute_start
                out[lo - start : hi - start].copy_(stored[lo + at : hi + at])
        return out

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        """Store bytes [start, end) of a compute layout held in `slot_buffer` (a slot, or host compute bytes) into
        `stored`, which holds stored bytes [stored_start, stored_start + stored.numel()) (the whole block, or a
        rank's shard): every coded span the range touches is coded again whole. Raises `_CodeOverflowError`
        before writing anything where a span's new values need more escapes than it keeps."""
        writes: list[tuple[torch.Tensor, int]] = []  # (stored bytes, where they start in the stored block)
        for s in self.segments:
            lo, hi = max(s.compute_start, start), min(s.compute_start + s.compute_nbytes, end)
            if lo >= hi:
                continue
            if s.kind == "coded":
                values = slot_buffer[s.compute_start : s.compute_start + s.compute_nbytes].cpu().view(torch.int16)
                coded = torch.zeros(s.stored_nbytes, dtype=torch.uint8)
                encode_into_(s.code, values, coded)  # raises before anything is written
                writes.append((coded, s.stored_start))
            else:
                writes.append((slot_buffer[lo:hi].cpu(), s.stored_start + lo - s.compute_start))
        return sum(_copy_window_(stored, stored_start, data, at) for data, at in writes)

    def stored_tensors(self, stored: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per layout entry with the block's values (decoded copies: the stored bytes are coded)."""
        return self.layout.views(self.compute_bytes(stored))


def _copy_window_(stored: torch.Tensor, stored_start: int, data: torch.Tensor, at: int) -> int:
    lo, hi = max(at, stored_start), min(at + data.numel(), stored_start + stored.numel())
    if lo >= hi:
        return 0
    stored[lo - stored_start : hi - stored_start].copy_(data[lo - at : hi - at])
    return hi - lo


class LosslessForms:
    """The lossless form of each block of one component, made once per layout; the stores that keep the
    component's blocks (local, disk tier, sharded) share it."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[BlockLayout, LosslessForm]] = {}  # id(layout) -> (layout, its form)

    def form(self, layout: BlockLayout) -> LosslessForm:
        known = self._known.get(id(layout))
        if known is not None and known[0] is layout:
            return known[1]
        form = LosslessForm(layout)
        self._known[id(layout)] = (layout, form)
        return form


class LosslessBlock(HostBufferBlock):
    """One block stored losslessly coded in a host buffer of this process (a `StoredBlock`)."""

    def __init__(self, form: LosslessForm, binder: TensorBinder, buffer: torch.Tensor, originals: list[torch.Tensor]):
        self.form = form
        self.layout = form.layout
        self.binder = binder
        self.buffer = buffer
        self.originals: list[torch.Tensor] | None = originals
        """The block's own tensors until the store commits (the rollback gives them back, identity kept)."""
        self.unpack = SlotUnpack(form)
        self._decoded: torch.Tensor | None = None
        """The decoded compute bytes `host_tensors()` gave views of, until `sync_host_tensors_`."""

    def __repr__(self) -> str:
        return f"LosslessBlock({self.path!r}, {self.host_bytes} of {self.layout.nbytes} bytes{', pinned' if self.pinned else ''})"

    @property
    def link_bytes(self) -> int:
        return self.form.stored_nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        form = self.form
        staging = slot_buffer[form.stored_offset : form.stored_offset + form.stored_nbytes]
        source, unpack = self.buffer, self.unpack

        def job() -> int:
            staging.copy_(source, non_blocking=True)  # one host-to-device copy per block: the coded bytes
            unpack.run_(slot_buffer)  # then the decode into the compute layout, on the device, in the copy's stream
            return form.stored_nbytes

        return job

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._check_held("backward through it")
        return self.form.compute_range(self.buffer, start, nbytes)

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._check_held("keep what was written into it")
        try:
            # a host-side copy from the device: it waits for the block's compute, which is what must finish first
            return self.form.write_slot_range_(self.buffer, 0, slot_buffer, start, end)
        except _CodeOverflowError as e:
            raise UnsupportedUseError(
                f"{self.path}: its new values do not fit the lossless code it was stored in at enable ({e}); the "
                "store keeps its previous values. Call handle.disable(), change the weights, and enable again"
            ) from e

    def host_tensors(self) -> list[torch.Tensor]:
        self._check_held("read its weights")
        if self._decoded is None:
            self._decoded = self.form.compute_bytes(self.buffer)
        return self.layout.views(self._decoded)

    def sync_host_tensors_(self, written: bool) -> None:
        decoded, self._decoded = self._decoded, None
        if written and decoded is not None:
            self.write_back_(decoded, 0, self.layout.nbytes)  # the store's bytes move: its version with them

    def _check_held(self, what: str) -> None:
        if self.buffer.numel() < self.form.stored_nbytes:
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
        """Real tensors on `device` again, decoded (the original bits), fresh storage per span; the buffer goes."""
        self.binder.bind_(self.layout.separate_copies(self.form.compute_bytes(self.buffer), device))
        self.release_()

    def release_(self) -> None:
        self.unpack.clear_()
        self._decoded = None
        self.release_buffer_()


class LosslessHostStore(HostBufferStore):
    """`HostStore` keeping one component's blocks losslessly coded in this process's memory."""

    kind = "lossless"

    def __init__(self, forms: LosslessForms | None = None):
        self.forms = forms if forms is not None else LosslessForms()
        super().__init__()
        self.blocks: dict[str, LosslessBlock] = {}
        self.bytes_read_from_files = 0
        self._files: MappedFiles | None = None
        self._reader: FileReader | None = None

    def __repr__(self) -> str:
        return f"LosslessHostStore({len(self.blocks)} blocks, {sum(b.host_bytes for b in self.blocks.values())} bytes)"

    def stored_form(self, layout: BlockLayout) -> LosslessForm:
        return self.forms.form(layout)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.forms.form(layout).slot_nbytes  # the decoded block and a staging region for the coded one

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.forms.form(layout).stored_nbytes  # what the host keeps: the coded bytes

    def stats(self) -> StoreStats:
        return StoreStats(
            bytes_read_from_files=self.bytes_read_from_files,
            lossless_stored_bytes=sum(b.form.stored_nbytes for b in self.blocks.values()),
            lossless_decoded_bytes=sum(b.layout.nbytes for b in self.blocks.values()),
        )

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> LosslessBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        form = self.forms.form(layout)
        buffer = page_aligned_empty(form.stored_nbytes, zeroed=True)  # its pages its own: it can be page-locked
        if self._files is None:  # weights still mapped from their files are read from the files (file_reads)
            self._files, self._reader = MappedFiles.snapshot(), FileReader()
        self.bytes_read_from_files += form.fill_(buffer, self._files, self._reader)
        originals = [current_tensor(e.module, e.name, e.is_param) for e in layout.entries]
        block = LosslessBlock(form, TensorBinder(layout, device), buffer, originals)
        if pin is not None:
            self._pinning.submit(block, pin)  # page-locking it overlaps with coding the next block
        block.binder.evict_()  # the originals stay referenced by the block until commit_
        self.blocks[layout.path] = block
        return block

    def commit_(self) -> None:
        self._close_files()
        self._pinning.finish(raise_errors=True)  # a failed pin still finds the originals for the rollback
        for block in self.blocks.values():
            block.forget_originals_()  # from here on the coded bytes are the only copy

    def rollback_(self) -> None:
        self._close_files()
        self._pinning.finish(raise_errors=False)
        for path in list(self.blocks):
            self.blocks.pop(path).rollback_()

    def _close_files(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._files.close()
            self._files = self._reader = None
