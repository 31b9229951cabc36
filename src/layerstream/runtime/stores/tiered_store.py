"""A host store in two tiers, composed with the others when `host_budget_gb` is set: the blocks the placement
keeps in host memory go to the host store (the component's own store), the blocks it puts on disk, and those of
the host pool of alternating DiTs, go to the disk store (`runtime.stores.disk`). The placement prices blocks in
the host store's figures; `place_` tells the tiered store which blocks went where. The streamer sees one
`HostStore`; each block's `StoredBlock` comes from its tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from layerstream.plan.placement import Placement
from layerstream.runtime.contracts import HostStore, HostStoreBase, Pinner, StoredBlock, StoreStats
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.stores.disk.disk_store import DiskHostStore


class TieredHostStore(HostStoreBase):
    """`HostStore` splitting blocks between a host store and a disk store as the placement's host tier says."""

    kind = "tiered"

    def __init__(self, host: HostStore, disk: DiskHostStore):
        self.host = host
        self.disk = disk
        self._on_disk: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"TieredHostStore(host={self.host!r}, disk={self.disk!r})"

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.host.slot_nbytes(layout)  # the disk store lays a block out as the host store does

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.host.host_nbytes(layout)  # what the block costs the budget if it stays in host memory

    def place_(self, placement: Placement) -> None:
        tier = placement.host_tier
        self._on_disk = frozenset(tier.from_disk_paths) if tier is not None else frozenset()
        self.host.place_(placement)
        self.disk.place_(placement)

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

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        self.host.follow_order_(successor, num_blocks)
        self.disk.follow_order_(successor, num_blocks)

    def stats(self) -> StoreStats:
        return self.host.stats() + self.disk.stats()

    def rollback_(self) -> None:
        try:
            self.disk.rollback_()
        finally:
            self.host.rollback_()

    def release_(self) -> None:
        try:
            self.disk.release_()
        finally:
            self.host.release_()

    def restore_(self, device: torch.device) -> None:
        try:
            self.disk.restore_(device)
        finally:
            self.host.restore_(device)
