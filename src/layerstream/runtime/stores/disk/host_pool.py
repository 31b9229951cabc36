"""The host pool of the disk tier: host memory shared by DiTs that run one after the other (Wan 2.2's experts).
Entry j holds the j-th pooled block of one DiT at a time; the first copy job of another DiT queues reads of all
its pooled blocks on an I/O thread, each job waiting only for its own. Only the copy-job thread changes an
entry's owner; each read waits for the device copy out of the entry first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from layerstream.errors import TransferError
from layerstream.runtime.contracts import Pinner
from layerstream.runtime.packing.host_buffer import page_aligned_empty
from layerstream.runtime.stores.disk.staging import DiskRead, copy_events, pin_all_or_none, unpin_all, wait_copied

logger = logging.getLogger(__name__)


class HostPool:
    """Buffers shared by the pooled blocks of alternating DiTs (see the module docstring)."""

    def __init__(self, entry_nbytes: Sequence[int], member_order: Mapping[str, Sequence[str]], device: torch.device, pin: Pinner | None):
        self.buffers = [page_aligned_empty(max(n, 1)) for n in entry_nbytes]  # each can be page-locked
        self._pinner = pin_all_or_none(self.buffers, pin)
        self._copied = copy_events(device, self._pinner, len(self.buffers))
        self._owner: list[DiskRead | None] = [None] * len(self.buffers)
        self._loads: list[Future | None] = [None] * len(self.buffers)
        self._member_order = member_order  # member -> its streamed blocks in chain order
        self._pooled: dict[str, list[DiskRead]] = {m: [] for m in member_order}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-pool-load")
        self.current: str | None = None  # the member whose blocks the entries hold or are being read for
        self.num_member_changes = 0
        self.bytes_loaded = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def pinned(self) -> bool:
        return self._pinner is not None

    def owner(self, entry: int) -> DiskRead | None:
        return self._owner[entry]

    def add_(self, block: DiskRead, holds_bytes: bool) -> None:
        """Register a staged block; `holds_bytes`: staging packed its bytes into its entry."""
        order = self._member_order[block.member]
        self._pooled[block.member].append(block)
        self._pooled[block.member].sort(key=lambda b: order.index(b.path))
        if holds_bytes:
            self._owner[block.entry] = block
            self.current = block.member

    def prepare_(self, member: str) -> None:
        if member != self.current:  # a block of another member is about to be copied: read its pooled blocks
            self._change_to_(member)

    def take_(self, block: DiskRead) -> int:
        """The entry holding `block`'s bytes, read first when it holds another block's (waits for the read)."""
        entry = block.entry
        if self.current != block.member or self._owner[entry] is not block:
            self._change_to_(block.member, first=block)
        load = self._loads[entry]
        if load is not None:
            try:
                load.result()
            except BaseException:
                self._owner[entry] = None  # read again the next time it runs
                raise
            finally:
                self._loads[entry] = None
        return entry

    def copy_out_(self, entry: int, block: DiskRead, slot_buffer: torch.Tensor) -> int:
        return block.copy_out_(self.buffers[entry], slot_buffer, self._copied[entry])  # after `take_`

    def _change_to_(self, member: str, first: DiskRead | None = None) -> None:
        if member != self.current:
            self.num_member_changes += 1
        self._drop_loads_(keep=member)
        self.current = member
        order = self._pooled[member]
        if first is not None:  # the block asked for first, then the rest in chain order (cyclic)
            k = order.index(first)
            order = order[k:] + order[:k]
        for block in order:
            if self._owner[block.entry] is block:
                continue  # its bytes are there, or on their way
            self._owner[block.entry] = block
            self._loads[block.entry] = self._io.submit(self._load_, block)

    def _drop_loads_(self, keep: str) -> None:
        """Cancel the reads still queued for members other than `keep`; wait for the one running."""
        for entry, load in enumerate(self._loads):
            if load is None or self._owner[entry].member == keep:  # (a read in flight always has an owner)
                continue
            if not load.cancel():
                try:
                    load.result()
                    continue  # read whole: the entry holds its owner's bytes, keep it
                except (OSError, TransferError):
                    logger.debug("pool read for entry %d failed; read again when needed", entry, exc_info=True)
            self._owner[entry] = None
            self._loads[entry] = None

    def _load_(self, block: DiskRead) -> None:
        entry = block.entry
        wait_copied(self._copied[entry])  # the device copy of the entry's previous owner must be done
        block.read_into_(self.buffers[entry][: block.stored_nbytes])
        self.bytes_loaded += block.stored_nbytes

    def close_(self) -> None:
        """Stop reading, then free the buffers (the engine is closed: no device copy reads them)."""
        for load in self._loads:
            if load is not None:
                load.cancel()
        self._io.shutdown(wait=True)
        self._loads = [None] * len(self._loads)
        self._owner = [None] * len(self._owner)
        unpin_all(self.buffers, self._pinner)
        self._pinner = None
        self.buffers, self._copied = [], []
