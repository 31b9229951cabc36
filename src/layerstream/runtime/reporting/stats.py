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
    """Bytes copied host -> device since enable."""
    num_transfers: int = 0
    num_sync_loads: int = 0
    """Blocks loaded synchronously because they were not prefetched (skipped blocks, changed order)."""
    stall_seconds: float = 0.0
    """Host time compute waited for copies; on an accelerator only the waits for disk-tier copies not yet queued
    (the GPU's stalls are in ``trace()``, with ``trace=True``)."""
    device_bytes: int = 0
    """The component's resident tensors; in the totals, plus the slot ring."""
    host_bytes: int = 0
    """Held by the store for this component, plus the pre-fuse copies kept for an exact LoRA unfuse."""
    pinned_host_bytes: int = 0
    num_streamed_blocks: int = 0
    num_resident_blocks: int = 0
    bytes_written_back: int = 0
    """Buffers that streamed blocks wrote during forward (running statistics), copied back into the host store."""
    copy_issue_seconds: float = 0.0
    """Host time compute spent handing copies to the engine (microseconds a block on an accelerator); with
    `stall_seconds`, the time the compute thread was blocked by streaming rather than queuing kernels."""


@dataclass(frozen=True)
class OffloadStats(ComponentStats):
    """Totals over every component, plus `per_component` (path -> ComponentStats) and runtime facts."""

    per_component: Mapping[str, ComponentStats] = field(default_factory=lambda: MappingProxyType({}))
    num_slots: int = 0
    slot_bytes: int = 0  # the whole slot ring
    max_materialized_blocks: int = 0
    """Most streamed blocks bound to slots at one time since enable."""
    engine: str = ""
    residency: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Per DiT: how many leading blocks stay resident, and why."""
    host_bytes_from_files: int = 0
    """Host store bytes read straight from checkpoint files at enable (the rest was copied from memory)."""
    disk_bytes_read: int = 0
    """Read by the disk tier (`host_budget_gb`) since enable: checkpoint files and spill files."""
    disk_stall_seconds: float = 0.0
    """Of the time compute waited for weights (or queued a disk-tier copy itself), the part spent on disk reads."""
    host_pool_bytes: int = 0
    """The pool alternating DiTs (Wan 2.2's experts) share under `host_budget_gb`: in the totals' `host_bytes`."""
    disk_staging_bytes: int = 0
    """The disk tier's staging ring: beside `host_bytes`, beyond `host_budget_gb`."""
    lossless_stored_bytes: int = 0
    """The blocks kept in the lossless form, as stored: what a transfer moves and host memory or disk keeps."""
    lossless_decoded_bytes: int = 0
    """The same blocks decoded: their compute layout in a slot."""
    host_budget: str = ""
    """With `host_budget_gb: "auto"`: the budget it chose and the figures it chose from; empty otherwise."""

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
    lane: str  # "copy" or "compute"
    label: str  # the block path
    start: float
    end: float
    slot: int
    stall: float = 0.0  # compute only: time the block waited for its copy before starting
    sync_load: bool = False
    component: str = ""  # tells the two experts of Wan 2.2 apart


@dataclass(frozen=True)
class OffloadTrace:
    """Copy and compute intervals of every block since enable (seconds, one clock for both lanes)."""

    intervals: tuple[TraceInterval, ...]

    def lane(self, name: str) -> tuple[TraceInterval, ...]:
        return tuple(i for i in self.intervals if i.lane == name)


@dataclass(frozen=True)
class StreamCounters:
    """The growing counters of `OffloadStats`: a stretch of time is ``StreamCounters.of(after) - .of(before)``."""

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
