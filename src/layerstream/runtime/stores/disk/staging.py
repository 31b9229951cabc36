"""The staging ring of the disk tier, and what it shares with the host pool: buffers pinned all or none, and
events that tell when the copy out of a buffer into a device slot (asynchronous from pinned memory) is done."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from layerstream.errors import TransferError
from layerstream.runtime.contracts import Pinner
from layerstream.runtime.packing.host_buffer import page_aligned_empty


class DiskRead(Protocol):
    """What the staging ring and the host pool need of a disk block (`disk_store.DiskBlock`)."""

    member: str | None
    entry: int | None

    @property
    def path(self) -> str: ...

    @property
    def stored_nbytes(self) -> int: ...

    def read_into_(self, buffer: torch.Tensor) -> None: ...

    def copy_out_(self, held: torch.Tensor, slot_buffer: torch.Tensor, event) -> int: ...


logger = logging.getLogger(__name__)

READ_AHEAD_DEPTH = 2  # one block ahead, the disk idles whenever the copy side is late to ask for the next
NUM_STAGING_BUFFERS = READ_AHEAD_DEPTH + 1  # the buffers the read-ahead fills, and the latest copy's


def pin_all_or_none(buffers: Sequence[torch.Tensor], pin: Pinner | None) -> Pinner | None:
    """Page-lock every buffer, or none (a ring's copies are all asynchronous or all in step); the pinner or None."""
    if pin is None:
        return None
    pinned = [b for b in buffers if pin.pin_(b)]  # (the engine registers off this thread: a refusal poisons nothing)
    if len(pinned) == len(buffers):
        return pin
    for b in pinned:
        pin.unpin_(b)
    return None


def copy_events(device: torch.device, pinner: Pinner | None, count: int) -> list:
    """One CUDA event per buffer, re-recorded per copy out of it, where copies are asynchronous (CUDA, pinned)."""
    cuda = device.type == "cuda" and pinner is not None
    return [_DeviceEvent(device) if cuda else None for _ in range(count)]


class _DeviceEvent:
    """A CUDA event waited for with its device current (an I/O thread's CUDA call would make a context on GPU 0)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event()

    def record(self) -> None:
        self.event.record()  # on the current stream: the copy job runs with the engine's device and stream

    def synchronize(self) -> None:
        with torch.cuda.device(self.device):
            self.event.synchronize()  # the host waits for the copy out of the buffer before overwriting it


def wait_copied(event) -> None:
    """Host-side wait for the device copy out of a buffer before a read overwrites it (usually done already)."""
    if event is not None:
        event.synchronize()


def unpin_all(buffers: Sequence[torch.Tensor], pinner: Pinner | None) -> None:
    if pinner is not None:
        for b in buffers:
            pinner.unpin_(b)


class StagingRing:
    """Host buffers disk blocks are read into, then copied to the slot; while a block is copied out, the I/O thread
    reads the next `READ_AHEAD_DEPTH` expected into the others: disk, link and compute run as three stages."""

    def __init__(self, nbytes: int, device: torch.device, pin: Pinner | None):
        self.buffers = [page_aligned_empty(max(nbytes, 1)) for _ in range(NUM_STAGING_BUFFERS)]  # each can be page-locked
        self._pinner = pin_all_or_none(self.buffers, pin)
        self._copied = copy_events(device, self._pinner, len(self.buffers))
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-disk-ahead")
        self._ahead: deque[tuple[str, int, Future]] = deque()  # (block path, buffer, read), in expected order
        self._last = 0  # the buffer the latest copy came from
        self.num_read_ahead_hits = 0
        self.num_read_ahead_misses = 0
        self.last_disk_wait = (0.0, 0.0)  # when the latest `copy_` waited for the disk (perf_counter)

    def copy_(self, block: DiskRead, slot_buffer: torch.Tensor, upcoming: Sequence[DiskRead] = ()) -> int:
        """Fill the slot with `block`'s bytes through a staging buffer; returns the bytes that crossed the link."""
        waited = time.perf_counter()
        i = self._take_(block)
        self.last_disk_wait = (waited, time.perf_counter())
        self._last = i
        self._read_ahead_(block, upcoming, i)  # first: the disk reads the next blocks while this one is copied
        return block.copy_out_(self.buffers[i], slot_buffer, self._copied[i])

    def _take_(self, block: DiskRead) -> int:
        """The buffer holding `block`'s bytes: the read-ahead's when it read this block, else read now."""
        position = next((k for k, (path, _, _) in enumerate(self._ahead) if path == block.path), None)
        if self._ahead:
            if position == 0:
                self.num_read_ahead_hits += 1
            else:
                self.num_read_ahead_misses += 1  # another order than predicted (a skipped block, an order not yet learned)
        if position is not None:
            self._drop_ahead_(position)  # the reads of blocks that were skipped
            _, i, future = self._ahead.popleft()
            future.result()  # compute waits here only if the disk has not finished yet; a bad file raises
            return i
        self._drop_ahead_(len(self._ahead))
        free = self._free_buffer_(busy=())
        wait_copied(self._copied[free])  # the device copy out of this buffer finishes before the read overwrites it
        block.read_into_(self.buffers[free][: block.stored_nbytes])  # checked before any byte reaches the slot
        return free

    def _read_ahead_(self, block: DiskRead, upcoming: Sequence[DiskRead], current: int) -> None:
        """Keep reads in flight for the next disk blocks: those issued in the expected order stay, others go."""
        wanted = [b for b in upcoming if b is not block][:READ_AHEAD_DEPTH]
        kept = 0
        while kept < min(len(self._ahead), len(wanted)) and self._ahead[kept][0] == wanted[kept].path:
            kept += 1
        while len(self._ahead) > kept:
            self._forget_(self._ahead.pop())
        for next_block in wanted[kept:]:
            i = self._free_buffer_(busy=(current,))

            def read(i: int = i, next_block: DiskRead = next_block) -> None:
                wait_copied(self._copied[i])  # on the I/O thread
                next_block.read_into_(self.buffers[i][: next_block.stored_nbytes])

            self._ahead.append((next_block.path, i, self._io.submit(read)))

    def _drop_ahead_(self, count: int) -> None:
        for _ in range(count):
            self._forget_(self._ahead.popleft())

    @staticmethod
    def _forget_(entry: tuple[str, int, Future]) -> None:
        path, _, future = entry
        try:
            future.result()  # a read that is not needed still owns its buffer until it ends
        except (OSError, TransferError):
            logger.debug("read-ahead of %s failed; it is read again when it runs", path, exc_info=True)

    def _free_buffer_(self, busy: tuple[int, ...]) -> int:
        """A buffer no read owns, not in `busy`; the latest copy's last (it may still be in flight)."""
        taken = {i for _, i, _ in self._ahead} | set(busy)
        free = [i for i in range(len(self.buffers)) if i not in taken]
        assert free, "staging ring: more reads ahead than buffers"
        others = [i for i in free if i != self._last]
        return others[0] if others else free[0]

    def close_(self) -> None:
        """Wait for the read-ahead, then free the buffers (the engine is closed: no device copy reads them)."""
        self._io.shutdown(wait=True)
        self._ahead.clear()
        unpin_all(self.buffers, self._pinner)
        self._pinner = None
        self.buffers, self._copied = [], []
