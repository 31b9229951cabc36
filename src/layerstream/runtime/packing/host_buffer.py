"""What the local stores' blocks share: one host buffer per block, page-locked on a thread of its own.

`HostBufferBlock` is the common part of `PackedBlock` and `CastBlock`: the path, the host bytes, whether the
buffer is pinned, and releasing it. `PinningThread` page-locks each filled buffer (`cudaHostRegister` costs
about as much as reading the bytes) while the store goes on reading the next block; the store waits for it
before it commits, and before it rolls back (a buffer is unpinned only once its pinning is over).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.contracts import Pinner, StoredBlockBase


class HostBufferBlock(StoredBlockBase):
    """A block held in `buffer`, a uint8 host tensor of this process."""

    layout: BlockLayout
    buffer: torch.Tensor
    pinner: Pinner | None = None

    @property
    def path(self) -> str:
        return self.layout.path

    @property
    def host_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def pinned(self) -> bool:
        return self.pinner is not None

    def pin_(self, pinner: Pinner) -> None:
        """Page-lock the buffer (a refusal leaves it pageable: copies from it are then synchronous)."""
        if pinner.pin_(self.buffer):
            self.pinner = pinner

    def release_buffer_(self) -> None:
        """Unpin and drop the buffer."""
        if self.pinner is not None:
            self.pinner.unpin_(self.buffer)
            self.pinner = None
        self.buffer = torch.empty(0, dtype=torch.uint8)


class PinningThread:
    """Pins blocks' buffers on one thread, in the order they are handed over."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []

    def submit(self, block: HostBufferBlock, pinner: Pinner) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-pin")
        self._jobs.append(self._pool.submit(block.pin_, pinner))

    def finish(self, *, raise_errors: bool) -> None:
        """Wait for every pin; with `raise_errors`, then raise the first failure."""
        jobs, self._jobs = self._jobs, []
        try:
            errors = [job.exception() for job in jobs]  # waits for each
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        first = next((e for e in errors if e is not None), None)
        if first is not None and raise_errors:
            raise first
