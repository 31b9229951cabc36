"""What the runtime reports: transfer counters, memory accounting and the per-block trace."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, astuple, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from layerstream.wording import format_bytes


@dataclass(frozen=True)
class ComponentStats:
    """Counters of one streamed (or swapped) component, or their totals."""

    bytes_transferred: int = 0
    """Bytes copied host -> device since enable (or the last `reset_stats`)."""
    num_transfers: int = 0
    """Block (or module) copies issued."""
    num_sync_loads: int = 0
    """Blocks loaded synchronously because they were not prefetched (skipped blocks, changed order)."""
    stall_seconds: float = 0.0
    """Host time compute waited for copies: every wait on the CPU engine. On an accelerator compute waits on the
    GPU, not the host, so this counts only the waits for disk-tier copies not yet queued (their read was late):
    enable with ``trace=True`` and read the GPU's stalls from ``trace()``."""
    device_bytes: int = 0
    """Device bytes: the component's resident tensors; in the totals, plus the slot ring."""
    host_bytes: int = 0
    """Host bytes held by the store for this component (pinned and pageable), plus the pre-fuse copies of blocks
    with fused LoRA adapters (kept to restore them exactly at unfuse)."""
    pinned_host_bytes: int = 0
    num_streamed_blocks: int = 0
    num_resident_blocks: int = 0
    bytes_written_back: int = 0
    """Bytes of buffers that streamed blocks wrote during forward (running statistics, counters), copied back
    into the host store so that the next call reads them."""
    copy_issue_seconds: float = 0.0
    """Host time compute spent handing copies to the copy engine (an accelerator engine queues each copy whose
    job does not wait on the host right there: microseconds a block). With `stall_seconds`, the time the compute
    thread was blocked by streaming rather than queuing kernels."""


@dataclass(frozen=True)
class OffloadStats(ComponentStats):
    """Totals over every component, plus `per_component` (path -> ComponentStats) and runtime facts."""

    per_component: Mapping[str, ComponentStats] = field(default_factory=lambda: MappingProxyType({}))
    num_slots: int = 0
    slot_bytes: int = 0
    """Bytes of the slot ring (all slots)."""
    max_materialized_blocks: int = 0
    """Most streamed blocks bound to slots at one time since enable."""
    engine: str = ""
    residency: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Per DiT: how many leading blocks stay resident, and why."""
    host_bytes_from_files: int = 0
    """Host store bytes read straight from checkpoint files at enable (the rest was copied from memory)."""
    disk_bytes_read: int = 0
    """Bytes the disk tier (`host_budget_gb`) read from disk since enable: checkpoint files and spill files."""
    disk_stall_seconds: float = 0.0
    """Of the time compute waited for weights (`stall_seconds`, and `copy_issue_seconds` where compute queued a
    disk-tier copy itself), the part it waited on the disk tier's reads."""
    host_pool_bytes: int = 0
    """Host bytes of the pool that alternating DiTs (Wan 2.2's experts) share under `host_budget_gb`: counted in
    the totals' `host_bytes`, not in any component's (it holds the blocks of whichever DiT runs)."""
    disk_staging_bytes: int = 0
    """Host bytes of the disk tier's staging ring: beside `host_bytes`, beyond `host_budget_gb`."""
    lossless_stored_bytes: int = 0
    """Bytes of the streamed blocks kept in the lossless form (`storage_dtype: "lossless"`), as stored: what a
    transfer of them moves and what host memory or disk keeps."""
    lossless_decoded_bytes: int = 0
    """Bytes of the same blocks decoded: their compute layout in a slot (the same bits as streaming them as they are)."""
    host_budget: str = ""
    """With `host_budget_gb: "auto"`: the budget it chose and the figures it chose from (free host memory and
    where it was read, what runs beside the store); empty otherwise."""

    def __str__(self) -> str:
        """A readable multi-line summary (the dataclass repr stays available through `repr`)."""
        slots = f"{self.num_slots} slots, {format_bytes(self.slot_bytes)} of slots" if self.num_slots else "no slots"
        lines = [
            f"offload ({self.engine or 'none'}): {slots}, "
            f"at most {self.max_materialized_blocks} blocks bound at once",
            f"  device {format_bytes(self.device_bytes)}, host {format_bytes(self.host_bytes)} "
            f"({format_bytes(self.pinned_host_bytes)} pinned)",
            f"  streamed {format_bytes(self.bytes_transferred)} in {self.num_transfers} transfers, "
            f"{self.num_sync_loads} synchronous loads, {self.stall_seconds:.3f} s stalled",
        ]
        if self.disk_bytes_read:
            lines.append(
                f"  read from disk (blocks beyond host_budget_gb): {format_bytes(self.disk_bytes_read)}, "
                f"{self.disk_stall_seconds:.3f} s stalled on the disk"
            )
        if self.host_pool_bytes or self.disk_staging_bytes:
            lines.append(
                f"  host pool of alternating DiTs {format_bytes(self.host_pool_bytes)} (in host), disk staging ring "
                f"{format_bytes(self.disk_staging_bytes)}"
            )
        if self.lossless_decoded_bytes:
            lines.append(
                f"  lossless: {format_bytes(self.lossless_stored_bytes)} stored for {format_bytes(self.lossless_decoded_bytes)} "
                f"decoded ({self.lossless_stored_bytes / self.lossless_decoded_bytes:.3f}x)"
            )
        if self.bytes_written_back:
            lines.append(f"  buffers written back: {format_bytes(self.bytes_written_back)}")
        for path, c in self.per_component.items():
            lines.append(
                f"  {path}: {c.num_streamed_blocks} streamed + {c.num_resident_blocks} resident blocks, "
                f"device {format_bytes(c.device_bytes)}, host {format_bytes(c.host_bytes)}, {c.num_transfers} transfers"
            )
        for path, text in self.residency.items():
            lines.append(f"  residency {path}: {text}")
        if self.host_budget:
            lines.append(f"  {self.host_budget}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_component"] = {k: asdict(v) for k, v in self.per_component.items()}
        out["residency"] = dict(self.residency)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass(frozen=True)
class TraceInterval:
    lane: str
    """"copy" or "compute"."""
    label: str
    """Block path."""
    start: float
    end: float
    slot: int
    stall: float = 0.0
    """Compute only: time the block waited for its copy before starting."""
    sync_load: bool = False
    component: str = ""
    """Path of the component the block belongs to (tells the two experts of Wan 2.2 apart)."""


@dataclass(frozen=True)
class OffloadTrace:
    """Copy and compute intervals of every block since enable (seconds, one clock for both lanes)."""

    intervals: tuple[TraceInterval, ...]

    def lane(self, name: str) -> tuple[TraceInterval, ...]:
        return tuple(i for i in self.intervals if i.lane == name)


@dataclass(frozen=True)
class StreamCounters:
    """The counters of `OffloadStats` that only grow, so that a stretch of time (one generation) is the
    difference of two readings: ``StreamCounters.of(after) - StreamCounters.of(before)``."""

    bytes_transferred: int = 0
    num_transfers: int = 0
    num_sync_loads: int = 0
    stall_seconds: float = 0.0
    disk_bytes_read: int = 0
    disk_stall_seconds: float = 0.0

    @classmethod
    def of(cls, stats: OffloadStats | None) -> StreamCounters:
        """The counters of `stats` (all zero for None: nothing is streamed)."""
        if stats is None:
            return cls()
        return cls(**{f.name: getattr(stats, f.name) for f in fields(cls)})

    def __sub__(self, other: StreamCounters) -> StreamCounters:
        return StreamCounters(*(mine - theirs for mine, theirs in zip(astuple(self), astuple(other))))
