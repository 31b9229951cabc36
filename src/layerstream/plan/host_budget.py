"""`host_budget_gb: "auto"`: the host budget a machine allows, decided from figures read elsewhere (pure).

The store may use the host memory this process may still take (`free_nbytes`, cgroups included) plus the
streamed blocks' bytes it already holds (packing frees them), minus what runs beside the store: the staging ring,
on a CPU device the slot ring and resident parts, and a reserve for what a generation allocates. Where every
block fits beside the rest there is no disk tier. `enable_offload` and `layerstream plan` both decide here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from layerstream.errors import OffloadError
from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.wording import GB, format_bytes

STAGING_RING = "disk staging ring"
"""The name of the one need that exists only with a disk tier."""


@dataclass(frozen=True)
class HostBudgetChoice:
    """What `host_budget_gb: "auto"` chose, and the figures it chose from (bytes)."""

    budget_nbytes: int | None
    """The host budget (None: every streamed block fits in host memory, no disk tier)."""
    free_nbytes: int
    """Host memory this process may still take when enabling."""
    free_source: str
    """Where `free_nbytes` came from (MemAvailable, a cgroup's limit, or a machine given to the planner)."""
    streamed_nbytes: int
    """Host bytes of every streamed block, as the host store keeps them."""
    held_nbytes: int = 0
    """Streamed bytes already in this process's memory (not file views): freed as they are packed (float8
    blocks are not counted: their own tensors stay until enabling commits)."""
    needs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """What runs beside the store in host memory, by name (the staging ring only with a disk tier)."""
    reserve_reason: str = ""
    """How the reserve among `needs` was reached: given by `host_reserve_gb`, or estimated and from what."""

    @property
    def budget_gb(self) -> float | None:
        return None if self.budget_nbytes is None else self.budget_nbytes / GB

    def describe(self) -> str:
        figures = f"{format_bytes(self.free_nbytes)} free ({self.free_source})"
        if self.held_nbytes:
            figures += f" + {format_bytes(self.held_nbytes)} of streamed blocks already in memory"
        needs = [(name, n) for name, n in self.needs.items() if self.budget_nbytes is not None or name != STAGING_RING]
        figures += "".join(f" - {name} {format_bytes(n)}" for name, n in needs)
        if self.reserve_reason:
            figures += f" [reserve {self.reserve_reason}]"
        streamed = format_bytes(self.streamed_nbytes)
        if self.budget_nbytes is None:
            return f'host_budget_gb "auto": {figures} holds every streamed block ({streamed}): no disk tier'
        return (
            f'host_budget_gb "auto": {figures} = a budget of {format_bytes(self.budget_nbytes)} for {streamed} of '
            "streamed blocks: the rest is read from disk"
        )

    def to_dict(self) -> dict[str, Any]:
        figures = {f.name.replace("_nbytes", "_bytes"): getattr(self, f.name) for f in fields(self)}
        return {**figures, "needs": dict(self.needs), "reason": self.describe()}


def choose_host_budget(
    *, free_nbytes: int, free_source: str, streamed_nbytes: int, needs: Mapping[str, int], held_nbytes: int = 0,
    reserve_reason: str = "",
) -> HostBudgetChoice:  # fmt: skip
    """The budget (see the module docstring). Raises `OffloadError`, naming the figures, where the memory
    cannot hold even what runs beside a store that keeps nothing (every block read from disk)."""
    needs = MappingProxyType(dict(needs))
    room = free_nbytes + held_nbytes - sum(needs.values())
    choice = HostBudgetChoice(None, free_nbytes, free_source, streamed_nbytes, held_nbytes, needs, reserve_reason)
    if streamed_nbytes <= room + needs.get(STAGING_RING, 0):
        return choice  # everything fits without a disk tier, whose staging ring is then not needed
    if room <= 0:
        beside = ", ".join(f"{name} {format_bytes(n)}" for name, n in needs.items())
        reserve = f"; the reserve {reserve_reason}" if reserve_reason else ""
        raise OffloadError(
            f'host_budget_gb = "auto": {format_bytes(free_nbytes)} of host memory is free ({free_source}), less than '
            f"what runs beside the host store even with every block on disk ({beside}{reserve}); free memory, lower "
            "host_reserve_gb, or give host_budget_gb as a number"
        )
    return HostBudgetChoice(room, free_nbytes, free_source, streamed_nbytes, held_nbytes, needs, reserve_reason)


def host_needs(
    plan: ResolvedOffloadPlan,
    placement: Any,
    *,
    device_is_host: bool,
    reserve_nbytes: int,
    num_staging_buffers: int,
    block_host_nbytes: Mapping[str, int],
    reserve_name: str = "reserve (host_reserve_gb)",
) -> dict[str, int]:
    """For `plan` placed as `placement` (a `plan.placement.Placement`, which records this module's choice)
    without a disk tier: what runs beside the host store in host memory, by name: the disk tier's staging ring
    (buffers of the largest streamed block as its store keeps it, `block_host_nbytes`: float8 bytes for a
    float8 block, not a whole slot), where the device is the host itself the slot ring and the resident parts
    (the non-streamed modules and resident blocks), components whose residency the pipeline manages (they wait
    in host memory), and the reserve (`reserve_nbytes`, under `reserve_name`)."""
    largest = max((block_host_nbytes[p] for p in placement.streamed_block_paths), default=0)
    needs = {STAGING_RING: num_staging_buffers * largest}
    managed = sum(c.total_bytes for c in plan.components if c.action == "on_demand")
    if device_is_host:
        streamed = set(placement.streamed_block_paths)
        resident = sum(c.total_bytes for c in plan.components if c.action in ("stream", "resident"))
        resident -= sum(n for c in plan.streamed for s in c.stacks for p, n in zip(s.block_paths, s.block_bytes) if p in streamed)
        needs["slot ring"] = placement.ring_nbytes
        needs["resident parts"] = resident
    if managed:
        needs["pipeline-managed components"] = managed
    needs[reserve_name] = reserve_nbytes
    return needs
