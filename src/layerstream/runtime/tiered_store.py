"""A host store in two tiers: the blocks the placement keeps in host memory go to the host store (the local
packed store), the blocks it puts on disk, and those of the host pool of alternating DiTs, go to the disk store
(`runtime.disk_store`). The streamer sees one `HostStore`; each block's `StoredBlock` comes from its tier."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerstream.plan.placement import HostTierChoice
from layerstream.runtime.disk_store import DiskHostStore
from layerstream.runtime.layout import BlockLayout
from layerstream.runtime.protocols import HostStore, Pinner, StoredBlock


class TieredHostStore:
    """`HostStore` splitting blocks between a host store and a disk store as `tier` says."""

    kind = "tiered"

    def __init__(self, host: HostStore, disk: DiskHostStore, tier: HostTierChoice):
        self.host = host
        self.disk = disk
        self.tier = tier
        self._on_disk = frozenset(tier.from_disk_paths)

    def __repr__(self) -> str:
        return f"TieredHostStore(host={self.host!r}, disk={self.disk!r})"

    @property
    def bytes_read_from_files(self) -> int:
        return getattr(self.host, "bytes_read_from_files", 0)  # host bytes staged from checkpoint files

    def follow_order_(self, successor, num_blocks: int) -> None:
        self.disk.follow_order_(successor, num_blocks)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.host.slot_nbytes(layout)

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        self.host.check_layouts_([l for l in layouts if l.path not in self._on_disk], slot_nbytes)
        self.disk.check_layouts_([l for l in layouts if l.path in self._on_disk], slot_nbytes)

    def report_failure_(self, error: BaseException) -> None:
        self.host.report_failure_(error)
        self.disk.report_failure_(error)

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> StoredBlock:
        store = self.disk if layout.path in self._on_disk else self.host
        return store.stage_(layout, device, pin)

    def commit_(self) -> None:
        self.host.commit_()
        self.disk.commit_()

    def rollback_(self) -> None:
        try:
            self.disk.rollback_()
        finally:
            self.host.rollback_()

    def restore_(self, device: torch.device) -> None:
        try:
            self.disk.restore_(device)
        finally:
            self.host.restore_(device)
