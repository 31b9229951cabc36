"""Every phase of a generation and its peak from its parts, on the device and the host. In layer mode every
device phase holds the weights that do not stream, the slot ring, the allowance and its own transient; residency
"auto" leaves the largest transient free, so resident blocks fill only what every phase allows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from layerstream.models.generation_estimates import PHASES, Transient
from layerstream.plan.placement import Placement
from layerstream.wording import format_bytes

WEIGHTS = "weights kept on the device"
SLOT_RING = "slot ring"
ALLOWANCE = "allowance (CUDA context, allocator)"


@dataclass(frozen=True)
class PhasePeak:
    """One phase's peak in one memory: its parts by name, and a note naming a choice (a tiled decode)."""

    phase: str
    parts: Mapping[str, int]
    note: str = ""

    @property
    def nbytes(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = " + ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n)
        note = f"; {self.note}" if self.note else ""
        return f"{self.phase} {format_bytes(self.nbytes)} ({parts}{note})"

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "parts": dict(self.parts), "note": self.note}


@dataclass(frozen=True)
class PhasePeaks:
    """Each phase's peak in one memory (the device's or the host's) and the one that bounds it."""

    memory_nbytes: int
    phases: tuple[PhasePeak, ...]
    weights_by_component: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Device: the bytes each component keeps there for the whole generation (the sum is `WEIGHTS`)."""

    @property
    def peak(self) -> PhasePeak:
        """The largest phase (the first to run, of equal ones)."""
        return max(self.phases, key=lambda p: p.nbytes)

    @property
    def fits(self) -> bool:
        return self.peak.nbytes <= self.memory_nbytes

    def phase(self, name: str) -> PhasePeak | None:
        return next((p for p in self.phases if p.phase == name), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "memory_bytes": self.memory_nbytes,
            "peak_bytes": self.peak.nbytes,
            "bounded_by": self.peak.phase,
            "phases": {p.phase: p.to_dict() for p in self.phases},
        }
        if self.weights_by_component:
            out["weights_by_component"] = dict(self.weights_by_component)
        return out


def device_weights_by_component(plan, placement: Placement) -> dict[str, int]:
    """Bytes each component keeps on the device in layer mode (all of it but its streamed blocks)."""
    streamed = set(placement.streamed_block_paths)
    out = {}
    for comp in plan.components:
        if comp.action in ("stream", "resident"):
            moved = sum(n for s in comp.stacks for p, n in zip(s.block_paths, s.block_bytes) if p in streamed)
            out[comp.display_path] = comp.total_bytes - (moved if comp.action == "stream" else 0)
    return out


def device_phase_peaks(
    plan, placement: Placement, transients: Iterable[Transient], *, memory_nbytes: int, allowance_nbytes: int,
    notes: Mapping[str, str] | None = None,
) -> PhasePeaks:  # fmt: skip
    """Each phase of `transients` on the device, with what every phase keeps there."""
    weights = device_weights_by_component(plan, placement)
    kept = {WEIGHTS: sum(weights.values()), SLOT_RING: placement.ring_nbytes, ALLOWANCE: allowance_nbytes}
    ordered = sorted(transients, key=lambda t: PHASES.index(t.phase))
    phases = tuple(PhasePeak(t.phase, MappingProxyType({**kept, t.what: t.nbytes}), (notes or {}).get(t.phase, "")) for t in ordered)
    return PhasePeaks(memory_nbytes, phases, MappingProxyType(weights))


def host_phase_peaks(
    *, memory_nbytes: int, baseline_nbytes: int, kept: Mapping[str, int], enabling: Mapping[str, int],
    generating: Mapping[str, int],
) -> PhasePeaks:  # fmt: skip
    """The host's two phases: enabling (the baseline, what the host plan keeps, and what enabling holds until it
    commits: `enabling`) and generating (the same with what a generation allocates: `generating`, the reserve)."""
    base = {"baseline (imports, device context)": baseline_nbytes, **kept}
    return PhasePeaks(
        memory_nbytes,
        (PhasePeak("loading and enabling", MappingProxyType({**base, **enabling})), PhasePeak("generating", MappingProxyType({**base, **generating}))),
    )
