"""What the blocks held in host buffers share (`HostBufferBlock`: the local and the sharded store's), and
`PinningThread`, which page-locks each filled buffer (`cudaHostRegister` costs about as much as reading the
bytes) while the store reads the next block; the store waits for it before it commits or rolls back.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.contracts import Pinner, StoredBlockBase


T = TypeVar("T")

PAGE_BYTES = mmap.PAGESIZE  # CUDA registers whole pages, and refuses one registered twice: buffers share none


def page_aligned_empty(nbytes: int, *, zeroed: bool = False) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` on pages of its own (at most two pages more than asked for)."""
    rounded = -(-max(nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
    raw = torch.zeros(rounded + PAGE_BYTES, dtype=torch.uint8) if zeroed else torch.empty(rounded + PAGE_BYTES, dtype=torch.uint8)
    shift = -raw.data_ptr() % PAGE_BYTES
    return raw[shift : shift + nbytes]


def on_own_thread(call: Callable[..., T], *args) -> T:
    """`call(*args)` on a short-lived thread of its own, waited for. CUDA keeps a failed call's error per host
    thread, and torch reads it after the next kernel launch there: a failed `cudaHostRegister` on the compute
    thread would fail an unrelated kernel later; on a thread that launches nothing it only leaves a buffer pageable."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-pin") as pool:
        return pool.submit(call, *args).result()


class HostBufferBlock(StoredBlockBase):
    """A block held in `buffer`, a uint8 host tensor of this process."""

    layout: BlockLayout
    buffer: torch.Tensor
    pinner: Pinner | None = None

    @property
    def host_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def pinned(self) -> bool:
        return self.pinner is not None

    @property
    def host_version(self) -> int | None:
        buffer = self.buffer
        # an inference tensor (a buffer made under torch.inference_mode) keeps no version counter
        return None if buffer.is_inference() else buffer._version

    def pin_(self, pinner: Pinner) -> None:
        """Page-lock the buffer (a refusal leaves it pageable: copies from it are then synchronous)."""
        if pinner.pin_(self.buffer):
            self.pinner = pinner

    def release_buffer_(self) -> None:
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
