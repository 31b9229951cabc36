"""The local host store: each streamed block's stored bytes in one contiguous host buffer of this process. A
packed block's original storage is freed before the next block is staged (never two copies of the model); a
float8 or lossless block keeps its original tensors until `commit_`, for an exact `rollback_`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.contracts import HostStoreBase, Job, Pinner, StoredForm, StoreStats
from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.forms.slot import SlotUnpack, stored_region
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.host_buffer import HostBufferBlock, PinningThread, page_aligned_empty
from layerstream.runtime.packing.host_memory import release_freed_memory
from layerstream.runtime.packing.layout import BlockLayout, TensorBinder
from layerstream.runtime.packing.upcast import FLOAT8_DTYPES

logger = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 16 * 2**20  # a block copied from this much memory gives its freed originals back at once


class LocalBlock(HostBufferBlock):
    """One block's stored bytes, in its form, in a host buffer of this process."""

    def __init__(self, form: StoredForm, binder: TensorBinder, buffer: torch.Tensor, originals: list[torch.Tensor] | None):
        self.form = form
        self.layout = form.layout
        self.binder = binder
        self.buffer = buffer
        self.original_device = self.layout.source_device()
        self.originals = originals  # until the commit, where the form is not the packed layout; None: only copy
        self.unpack = SlotUnpack(form)
        self._decoded: torch.Tensor | None = None  # a coded form's bytes `host_tensors()` viewed, until synced

    def __repr__(self) -> str:
        return f"LocalBlock({self.path!r}, {self.host_bytes} bytes as {self.form!r}{', pinned' if self.pinned else ''})"

    @property
    def link_bytes(self) -> int:
        return self.form.stored_nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        destination, source, unpack, nbytes = stored_region(self.form, slot_buffer), self.buffer, self.unpack, self.form.stored_nbytes

        def job() -> int:
            destination.copy_(source, non_blocking=True)  # one contiguous host-to-device copy per block
            unpack.run_(slot_buffer)  # then the casts or decodes into the compute layout, on the device
            return nbytes

        return job

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._check_held("backward through it")
        return self.form.compute_range(self.buffer, start, nbytes)

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._check_held("keep what its forward wrote")
        # a host-side copy from the device: it waits for the block's compute, which is what must finish first
        return self.form.write_slot_range_(self.buffer, 0, slot_buffer, start, end)

    def host_tensors(self) -> list[torch.Tensor]:
        self._check_held("read its weights")
        if not self.form.coded:
            return self.form.stored_tensors(self.buffer)  # views of the store's bytes
        if self._decoded is None:
            self._decoded = self.form.compute_bytes(self.buffer)
        return self.layout.views(self._decoded)

    def sync_host_tensors_(self, written: bool) -> None:
        decoded, self._decoded = self._decoded, None
        if written and decoded is not None:
            self.write_back_(decoded, 0, self.layout.nbytes)  # the store's bytes move: its version with them

    def check_lora_(self) -> None:
        if not self.form.lossless:
            raise UnsupportedUseError(
                f"{self.path}: LoRA on a block stored with storage_dtype {self.form.signature.split()[0]} is not "
                "supported (the adapters would be created in the storage dtype); load and fuse LoRA before enabling "
                "offload, or call handle.disable() first"
            )
        float8 = next((e for e in self.layout.entries if e.dtype in FLOAT8_DTYPES), None)
        if float8 is not None:  # an fp8_scaled checkpoint's weights, kept float8: PEFT would make float8 adapters
            raise UnsupportedUseError(
                f"{self.path}: LoRA on a block holding float8 weights (a {type(float8.module).__name__}'s {float8.name}, as an fp8_scaled file keeps "
                "them) is not supported (the adapters would be created in float8); load the transformer in its own "
                "dtype to use LoRA"
            )

    def _check_held(self, what: str) -> None:
        if self.buffer.numel() < self.form.stored_nbytes:
            raise UnsupportedUseError(
                f"{self.path}: offload was disabled since this block ran, so its host copy is gone; cannot {what}"
            )

    def forget_originals_(self) -> None:
        if self.originals is not None:
            self.originals = None
            self.layout.forget_sources()

    def rollback_(self) -> None:
        """Give the block its original tensors back: the very ones where it kept them, else made from the buffer."""
        if self.originals is None:
            self.restore_(self.original_device)
            return
        self.binder.bind_(self.originals)
        self.originals = None
        self.release_()

    def restore_(self, device: torch.device) -> None:
        # float8 weights keep the values they were rounded to
        self.binder.bind_(self.layout.separate_copies(self.form.compute_bytes(self.buffer), device))
        self.release_()

    def release_(self) -> None:
        self.unpack.clear_()
        self._decoded = None
        self.release_buffer_()


class LocalHostStore(HostStoreBase):
    """`HostStore` keeping every block whole in this process's memory (`weight_transfer: "rank-local"`)."""

    kind = "local"

    def __init__(self, form_of: Callable[[BlockLayout], StoredForm] = PackedForm):
        self.form_of = form_of
        self.blocks: dict[str, LocalBlock] = {}
        self.bytes_read_from_files = 0
        self._pinning = PinningThread()
        self._files: MappedFiles | None = None
        self._reader: FileReader | None = None

    def __repr__(self) -> str:
        return f"LocalHostStore({len(self.blocks)} blocks, {sum(b.host_bytes for b in self.blocks.values())} bytes)"

    def stored_form(self, layout: BlockLayout) -> StoredForm:
        return self.form_of(layout)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.form_of(layout).slot_nbytes  # float8, lossless: the compute layout, then the stored bytes

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.form_of(layout).stored_nbytes  # what the host keeps: the stored bytes

    def stats(self) -> StoreStats:
        return StoreStats.of_forms((b.form for b in self.blocks.values()), bytes_read_from_files=self.bytes_read_from_files)

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> LocalBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        form = self.form_of(layout)
        keeps_originals = not form.stored_is_packed  # a rollback must not read back rounded or coded bytes
        # its pages its own: it can always be page-locked (zeroed where the form leaves padding unwritten)
        buffer = page_aligned_empty(form.stored_nbytes, zeroed=keeps_originals)
        if self._files is None:  # weights still mapped from their files are read from the files (file_reads)
            self._files, self._reader = MappedFiles.snapshot(), FileReader()
        from_files = form.fill_(buffer, self._files, self._reader)
        self.bytes_read_from_files += from_files
        binder = TensorBinder(form.layout, device)
        block = LocalBlock(form, binder, buffer, binder.current_tensors() if keeps_originals else None)
        if pin is not None:
            self._pinning.submit(block, pin)  # page-locking it overlaps with reading the next block
        binder.evict_()
        if not keeps_originals:
            form.layout.forget_sources()  # the original storage is freed here, before the next block is staged
            from_memory = sum(length for _, length in form.layout.span_placements()) - from_files
            if block.original_device.type == "cpu" and from_memory >= TRIM_AFTER_BYTES:
                release_freed_memory()  # and given back to the system, not kept in the heap beside the stored copy
        self.blocks[layout.path] = block
        return block

    def commit_(self) -> None:
        self._close_files()
        self._pinning.finish(raise_errors=True)  # a failed pin still finds the originals for the rollback
        for block in self.blocks.values():
            block.forget_originals_()  # from here on the stored bytes are the only copy

    def rollback_(self) -> None:
        self._close_files()
        self._pinning.finish(raise_errors=False)  # a block is unpinned only once its pinning is over
        for path in list(self.blocks):
            self.blocks.pop(path).rollback_()

    def restore_(self, device: torch.device) -> None:
        # one block at a time, forgotten once restored: a second call never restores a block twice
        for path in list(self.blocks):
            self.blocks[path].restore_(device)
            del self.blocks[path]

    def release_(self) -> None:
        self._pinning.finish(raise_errors=False)  # a buffer is unpinned only once its pinning is over
        for path in list(self.blocks):
            self.blocks.pop(path).release_()

    def _close_files(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._files.close()
            self._files = self._reader = None
