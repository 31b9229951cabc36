"""A host store in two tiers, for `host_budget_gb`: the placement's host blocks go to their component's store
(the host side, whose figures it prices), the others to the one disk store, in the host side's form and part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from layerstream.plan.placement import Placement
from layerstream.runtime.contracts import DiskPart, HostStore, HostStoreBase, Pinner, StoredBlock, StoredForm, StoreStats
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.stores.disk.disk_store import DiskHostStore


class TieredHostStore(HostStoreBase):
    """Blocks split between host stores (one, or each block path's) and a disk store, as the placement says."""

    kind = "tiered"

    def __init__(self, host: HostStore | Mapping[str, HostStore], disk: DiskHostStore):
        if isinstance(host, Mapping):
            self._host_of: Mapping[str, HostStore] | None = dict(host)
            self.hosts = list({id(store): store for store in host.values()}.values())
        else:
            self._host_of = None
            self.hosts = [host]
        self.disk = disk
        self._on_disk: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"TieredHostStore(hosts={self.hosts!r}, disk={self.disk!r})"

    def host_for(self, layout: BlockLayout) -> HostStore:
        return self.hosts[0] if self._host_of is None else self._host_of[layout.path]

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return self.host_for(layout).slot_nbytes(layout)  # the disk store lays a block out as its host store does

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.host_for(layout).host_nbytes(layout)  # what the block costs the budget if it stays in host memory

    def stored_form(self, layout: BlockLayout) -> StoredForm:
        return self.host_for(layout).stored_form(layout)

    def disk_part(self, layout: BlockLayout) -> DiskPart:
        return self.host_for(layout).disk_part(layout)

    def place_(self, placement: Placement) -> None:
        tier = placement.host_tier
        self._on_disk = frozenset(tier.from_disk_paths) if tier is not None else frozenset()
        for host in self.hosts:
            host.place_(placement)
        self.disk.place_(placement)

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        for host in self.hosts:  # every block it is the host side of, on disk too (see the module docstring)
            host.check_layouts_([l for l in layouts if self.host_for(l) is host], slot_nbytes)
        self.disk.check_layouts_([l for l in layouts if l.path in self._on_disk], slot_nbytes)

    def report_failure_(self, error: BaseException) -> None:
        for host in self.hosts:
            host.report_failure_(error)
        self.disk.report_failure_(error)

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> StoredBlock:
        store = self.disk if layout.path in self._on_disk else self.host_for(layout)
        return store.stage_(layout, device, pin)

    def commit_(self) -> None:
        for host in self.hosts:
            host.commit_()
        self.disk.commit_()

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        for host in self.hosts:
            host.follow_order_(successor, num_blocks)
        self.disk.follow_order_(successor, num_blocks)

    def stats(self) -> StoreStats:
        return sum((host.stats() for host in self.hosts), self.disk.stats())

    def rollback_(self) -> None:
        self._each_(lambda store: store.rollback_())

    def release_(self) -> None:
        self._each_(lambda store: store.release_())

    def restore_(self, device: torch.device) -> None:
        # nothing reads ahead any more, then the host stores (the sharded one reads its shards on disk), then
        # the disk store, which removes the spill files
        self.disk.stop_reading_()
        self._each_(lambda store: store.restore_(device), (*self.hosts, self.disk))

    def _each_(self, step: Callable[[HostStore], None], stores: Sequence[HostStore] | None = None) -> None:
        """`step` on each store (default: disk, then hosts); the first failure is raised after all of them ran."""
        first_error: BaseException | None = None
        for store in stores if stores is not None else (self.disk, *self.hosts):
            try:
                step(store)
            except BaseException as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
