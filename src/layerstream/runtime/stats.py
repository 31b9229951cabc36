"""What the runtime reports: transfer counters, memory accounting and the per-block trace."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any


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
    """Time compute waited for copies, measured by the CPU engine. On an accelerator compute waits on the GPU,
    not the host, so this stays 0 there: enable with ``trace=True`` and read the stalls from ``trace()``."""
    device_bytes: int = 0
    """Device bytes: the component's resident tensors; in the totals, plus the slot ring."""
    host_bytes: int = 0
    """Host bytes held by the store for this component (pinned and pageable)."""
    pinned_host_bytes: int = 0
    num_streamed_blocks: int = 0
    num_resident_blocks: int = 0


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
