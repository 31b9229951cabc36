"""The local packed host store: each streamed block's tensors in one contiguous host buffer of this process.

Staging copies a block's spans into its buffer (pinned at the exact size when the device has a DMA engine: no
power-of-two rounding; a pinning thread page-locks each filled buffer while the next block is read) and at once rebinds the block to empty placeholders, so the original storage is freed
before the next block is staged and host memory never holds two copies of the model. Parameter objects keep
their identity: parameters are rebound through `.data`, buffers by assignment.
"""

from __future__ import annotations

import logging

import torch

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.host_buffer import HostBufferBlock, page_aligned_empty
from layerstream.runtime.packing.host_memory import release_freed_memory
from layerstream.runtime.packing.layout import BlockLayout, TensorBinder
from layerstream.runtime.stores.buffer_store import HostBufferStore
from layerstream.runtime.contracts import Job, Pinner, StoreStats

logger = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 16 * 2**20
"""A block copied from this much host memory or more has its freed originals given back to the system at once
(a block read from the checkpoint files freed only views of the mapping: nothing to give back)."""


class PackedBlock(HostBufferBlock):
    """One block's packed bytes in a host buffer of this process."""

    def __init__(self, layout: BlockLayout, binder: TensorBinder, buffer: torch.Tensor, original_device: torch.device):
        self.layout = layout
        self.binder = binder
        self.buffer = buffer
        self.original_device = original_device

    def __repr__(self) -> str:
        return f"PackedBlock({self.path!r}, {self.host_bytes} bytes{', pinned' if self.pinned else ''})"

    @property
    def link_bytes(self) -> int:
        return self.layout.nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        destination = slot_buffer[: self.layout.nbytes]
        source = self.buffer
        nbytes = self.layout.nbytes

        def job() -> int:
            destination.copy_(source, non_blocking=True)  # one contiguous copy per block
            return nbytes

        return job

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._check_held("backward through it")
        return self.buffer[start : start + nbytes]

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._check_held("keep what its forward wrote")
        # a host-side copy from the device: it waits for the block's compute, which is what must finish first
        self.buffer[start:end].copy_(slot_buffer[start:end])
        return end - start

    def host_tensors(self) -> list[torch.Tensor]:
        self._check_held("read its weights")
        return self.layout.views(self.buffer)

    def _check_held(self, what: str) -> None:
        if self.buffer.numel() < self.layout.nbytes:
            raise UnsupportedUseError(
                f"{self.path}: offload was disabled since this block ran, so its host copy is gone; cannot {what}"
            )

    def restore_(self, device: torch.device) -> None:
        """Real tensors on `device` again (fresh storage per span, same residues); the host buffer goes."""
        self.binder.bind_(self.layout.separate_copies(self.buffer, device))
        self.release_()

    def release_(self) -> None:
        self.release_buffer_()


class PackedHostStore(HostBufferStore):
    """`HostStore` keeping every block whole in this process's memory (`weight_transfer: "rank-local"`)."""

    kind = "packed"

    def __init__(self):
        super().__init__()
        self.blocks: dict[str, PackedBlock] = {}
        self.bytes_read_from_files = 0
        self._files: MappedFiles | None = None
        self._reader: FileReader | None = None

    def __repr__(self) -> str:
        return f"PackedHostStore({len(self.blocks)} blocks, {sum(b.host_bytes for b in self.blocks.values())} bytes)"

    def stats(self) -> StoreStats:
        return StoreStats(bytes_read_from_files=self.bytes_read_from_files)

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> PackedBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        original_device = layout.source_device()
        buffer = page_aligned_empty(layout.nbytes)  # its pages its own: it can always be page-locked
        if self._files is None:  # weights still mapped from their files are read from the files (file_reads)
            self._files, self._reader = MappedFiles.snapshot(), FileReader()
        from_files = layout.copy_sources_into(buffer, self._files, self._reader)
        self.bytes_read_from_files += from_files
        from_memory = sum(length for _, length in layout.span_placements()) - from_files
        block = PackedBlock(layout, TensorBinder(layout, device), buffer, original_device)
        if pin is not None:
            self._pinning.submit(block, pin)  # page-locking it overlaps with reading the next block
        block.binder.evict_()
        layout.forget_sources()  # the original storage is freed here, before the next block is staged
        if original_device.type == "cpu" and from_memory >= TRIM_AFTER_BYTES:
            release_freed_memory()  # and given back to the system, not kept in the heap beside the packed copy
        self.blocks[layout.path] = block
        return block

    def commit_(self) -> None:
        self._close_files()  # each block dropped its originals when staged
        self._pinning.finish(raise_errors=True)

    def rollback_(self) -> None:
        self._close_files()
        self._pinning.finish(raise_errors=False)  # a block is unpinned only once its pinning is over
        for path in list(self.blocks):
            block = self.blocks.pop(path)
            block.restore_(block.original_device)

    def _close_files(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._files.close()
            self._files = self._reader = None
