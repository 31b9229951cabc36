"""Placement: where every streamable block goes, decided once, as plain data that `enable_offload`, `layerstream plan`,
residency "auto" and the benchmarks read (nothing recomputes it): which DiT blocks stay resident, the prefetch chains,
the slot ring, and with `host_budget_gb` which streamed blocks the host holds and which are read from disk. Resident
blocks ("auto": within the device budget, `read_device_budget`) and host blocks are spread evenly through each chain
rather than leading it: each resident or host block gives the next streamed or disk block's transfer time to hide in.
The host choice is fixed, not a cache: a denoising loop runs the blocks in the same cyclic order every step, and
least-recently-used would evict exactly the block needed next. DiTs that run one after the other
(`ResolvedComponent.alternates`, Wan 2.2's experts) share one host pool: entry j holds the j-th host block of whichever
ran last (docs/storage.md, the disk tier)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from types import MappingProxyType
from typing import Any

from layerstream.config.offload_config import DEFAULT_ACTIVATION_RESERVE_GB
from layerstream.errors import OffloadError
from layerstream.plan.host_budget import HostBudgetChoice
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan
from layerstream.wording import GB

SLOT_ALIGN_BYTES = 64
"""Slots start at this alignment and their size is a multiple of it (the runtime's span alignment)."""


@dataclass(frozen=True)
class DeviceBudget:
    """Device bytes offload may use for resident modules, slots and resident blocks, and where the figure came from."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class ActivationReserve:
    """Device memory residency "auto" leaves beside the resident parts, estimated for a generation (the caller's:
    `offload.estimated_activation_reserve`), and how."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class ResidencyChoice:
    """Which blocks of one streamed component's main chain stay on the device, and why."""

    resident_block_paths: tuple[str, ...]
    num_blocks: int
    reason: str

    def describe(self) -> str:
        return f"{len(self.resident_block_paths)}/{self.num_blocks} blocks resident: {self.reason}"


@dataclass(frozen=True)
class PrefetchChain:
    """Streamed blocks that prefetch one another in this order (the last one prefetches the first)."""

    component: str
    block_paths: tuple[str, ...]
    prefetch_depth: int


@dataclass(frozen=True)
class HostPoolChoice:
    """Host memory shared by DiTs that run one after the other: entry j holds the j-th host block of one of
    them at a time (see the module docstring)."""

    members: tuple[str, ...]
    entries: tuple[tuple[str, ...], ...]
    """Per entry, the blocks that share it (at most one per member)."""
    entry_nbytes: tuple[int, ...]
    """Per entry, the bytes of its largest block."""
    member_blocks: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Member -> every streamed block of it, pooled or on disk, in chain order (a block of a member that runs
    tells the pool which member runs)."""

    @property
    def nbytes(self) -> int:
        return sum(self.entry_nbytes)

    @property
    def block_paths(self) -> tuple[str, ...]:
        return tuple(p for entry in self.entries for p in entry)

    def entry_of(self, path: str) -> int | None:
        return next((j for j, entry in enumerate(self.entries) if path in entry), None)

    def member_of(self, path: str) -> str | None:
        return next((m for m, blocks in self.member_blocks.items() if path in blocks), None)

    def to_dict(self) -> dict[str, Any]:
        return {"members": list(self.members), "bytes": self.nbytes, "entries": [list(e) for e in self.entries]}


@dataclass(frozen=True)
class HostTierChoice:
    """Which streamed blocks the host store holds within `host_budget_gb` and which are read from disk, and why."""

    budget_nbytes: int
    host_block_paths: tuple[str, ...]
    """Held in host memory (the local packed store), in chain order."""
    disk_block_paths: tuple[str, ...]
    """Read from disk at every use (the checkpoint's files, or spill files), in chain order."""
    host_nbytes: int
    """Host bytes of the host blocks (each block's packed bytes)."""
    reason: str
    pool: HostPoolChoice | None = None
    """The host pool of the alternating DiTs (None: no pool). Its blocks are not in `host_block_paths`."""

    def on_disk(self, path: str) -> bool:
        return path in self.disk_block_paths

    def pooled(self, path: str) -> bool:
        return self.pool is not None and path in self.pool.block_paths

    @property
    def from_disk_paths(self) -> tuple[str, ...]:
        """The blocks the disk store holds: the disk blocks and the pooled ones (read from disk into the pool)."""
        return self.disk_block_paths + (self.pool.block_paths if self.pool is not None else ())

    def describe(self) -> str:
        pooled = f", {len(self.pool.block_paths)} in the host pool" if self.pool is not None else ""
        return (
            f"{len(self.host_block_paths)} blocks on the host{pooled}, {len(self.disk_block_paths)} on disk: "
            f"{self.reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_nbytes,
            "host_bytes": self.host_nbytes,
            "host_blocks": list(self.host_block_paths),
            "disk_blocks": list(self.disk_block_paths),
            **({"pool": self.pool.to_dict()} if self.pool is not None else {}),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Placement:
    """Where every streamable block goes (see the module docstring)."""

    residency: Mapping[str, ResidencyChoice]
    chains: tuple[PrefetchChain, ...]
    """Non-empty chains of streamed blocks, in declared order."""
    num_slots: int
    """Device slots of the ring shared by every streamed component (0 when nothing streams)."""
    slot_nbytes: int
    """Bytes of one slot: the largest streamed block as its store lays it out, aligned."""
    block_slot_nbytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    host_tier: HostTierChoice | None = None
    """With `host_budget_gb`: which streamed blocks live in host memory and which on disk (None: all on the host)."""
    host_budget: HostBudgetChoice | None = None
    """With `host_budget_gb: "auto"`: the budget it chose and the figures it chose from."""

    @property
    def ring_nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    @property
    def streamed_block_paths(self) -> tuple[str, ...]:
        return tuple(p for chain in self.chains for p in chain.block_paths)

    def resident_block_paths(self, component: str) -> tuple[str, ...]:
        choice = self.residency.get(component)
        return choice.resident_block_paths if choice is not None else ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_nbytes,
            "ring_bytes": self.ring_nbytes,
            "residency": {
                path: {"resident_blocks": list(c.resident_block_paths), "num_blocks": c.num_blocks, "reason": c.reason}
                for path, c in self.residency.items()
            },
            "chains": [{"component": c.component, "num_blocks": len(c.block_paths), "prefetch_depth": c.prefetch_depth} for c in self.chains],
            **({"host_tier": self.host_tier.to_dict()} if self.host_tier is not None else {}),
            **({"host_budget": self.host_budget.to_dict()} if self.host_budget is not None else {}),
        }


def align_slot(nbytes: int) -> int:
    return (nbytes + SLOT_ALIGN_BYTES - 1) // SLOT_ALIGN_BYTES * SLOT_ALIGN_BYTES


def main_chain(comp: ResolvedComponent) -> list[str]:
    """Blocks on the component's own prefetch chain, in declared order (`resident_layers` counts along it)."""
    return [p for s in comp.stacks if not s.own_chain for p in s.block_paths]


def needs_device_budget(plan: ResolvedOffloadPlan) -> bool:
    """Whether placing this plan reads a device budget (some DiT asks for `resident_layers: "auto"`)."""
    return any(c.category == "dit" and c.resident_layers == "auto" and c.resident_allowed for c in plan.streamed)


def read_device_budget(
    plan: ResolvedOffloadPlan, device, free_bytes: int | None, estimated: ActivationReserve | None = None,
) -> DeviceBudget:  # fmt: skip
    """The budget for residency "auto": `device_budget_gb`, else `free_bytes` of the device minus the
    activation reserve: `activation_reserve_gb`, else `estimated` (the generation's), else the default
    `DEFAULT_ACTIVATION_RESERVE_GB` (no generation to estimate it for). `free_bytes` is None where there is no
    device memory to read (the CPU)."""
    options = plan.config.options_for("dit")
    if options.device_budget_gb is not None:
        return DeviceBudget(round(options.device_budget_gb * GB), f"device_budget_gb={options.device_budget_gb:g}")
    if free_bytes is None:
        raise OffloadError(
            f'layer_options.dit.resident_layers = "auto" on device {device}: there is no device memory to read; '
            "give layer_options.dit.device_budget_gb"
        )
    if options.activation_reserve_gb is not None:
        reserve, why = round(options.activation_reserve_gb * GB), f"activation_reserve_gb={options.activation_reserve_gb:g}"
    elif estimated is not None:
        reserve, why = estimated.nbytes, f"the activation reserve {estimated.nbytes / GB:.3g} GB ({estimated.source})"
    else:
        reserve = round(DEFAULT_ACTIVATION_RESERVE_GB * GB)
        why = f"activation_reserve_gb={DEFAULT_ACTIVATION_RESERVE_GB:g} (the default: no generation to estimate it for)"
    return DeviceBudget(int(free_bytes - reserve), f"free device memory {free_bytes / GB:.3g} GB minus {why}")


def place_blocks(
    plan: ResolvedOffloadPlan,
    block_slot_nbytes: Mapping[str, int],
    budget: DeviceBudget | None = None,
    block_host_nbytes: Mapping[str, int] | None = None,
) -> Placement:
    """Decide residency, chains, the slot ring and the host tier. `block_slot_nbytes` gives every streamable block's
    slot bytes as its store will lay it out (what the ring is sized in) and `block_host_nbytes` its host bytes (what
    `host_budget_gb` is spent in; default: the slot bytes); `budget` is needed when a DiT asks for residency "auto"."""
    host_sizes = block_host_nbytes if block_host_nbytes is not None else block_slot_nbytes
    residency = _choose_residency(plan, block_slot_nbytes, budget)
    chains = []
    for comp in plan.streamed:
        kept = set(residency[comp.path].resident_block_paths)
        for chain in _chains_of(comp):
            streamed = tuple(p for p in chain if p not in kept)
            if streamed:
                chains.append(PrefetchChain(comp.path, streamed, comp.prefetch_depth))
    streamed_sizes = {p: block_slot_nbytes[p] for c in chains for p in c.block_paths}
    num_slots = max((c.prefetch_depth for c in chains), default=0) + 1 if chains else 0
    slot_nbytes = align_slot(max(streamed_sizes.values(), default=0))
    host_budget_gb = plan.config.host_budget_gb
    alternating = tuple(c.path for c in plan.streamed if c.alternates and any(ch.component == c.path for ch in chains))
    host_tier = (
        _choose_host_tier(chains, {p: host_sizes[p] for p in streamed_sizes}, host_budget_gb, alternating if len(alternating) > 1 else ())
        if host_budget_gb is not None
        else None
    )
    return Placement(
        MappingProxyType(residency), tuple(chains), num_slots, slot_nbytes, MappingProxyType(streamed_sizes), host_tier
    )


def _choose_host_tier(
    chains: list[PrefetchChain], host_nbytes: Mapping[str, int], budget_gb: float, alternating: tuple[str, ...] = ()
) -> HostTierChoice:
    """Host blocks spread through each chain while they fit in the budget; the chains of the `alternating` DiTs
    share a pool when the streamed blocks do not all fit."""
    budget = round(budget_gb * GB)
    total = sum(host_nbytes[p] for c in chains for p in c.block_paths)
    if total <= budget:
        alternating = ()  # every block fits: nothing to share, and nothing read again at a change of expert

    def layout(counts: list[int]) -> tuple[int, list[str], list[list[str]]]:
        """(host bytes, blocks held for the whole run, pool entries) of these counts."""
        fixed: list[str] = []
        per_member: dict[str, list[str]] = {m: [] for m in alternating}
        for chain, count in zip(chains, counts):
            paths = chain.block_paths
            (per_member.get(chain.component, fixed)).extend(paths[j] for j in spread_indices(len(paths), count))
        entries = [[p for p in entry if p is not None] for entry in zip_longest(*per_member.values())]
        used = sum(host_nbytes[p] for p in fixed) + sum(max(host_nbytes[p] for p in e) for e in entries)
        return used, fixed, entries

    counts = _hand_out([len(c.block_paths) for c in chains], lambda counts: layout(counts)[0] <= budget)
    used, host, entries = layout(counts)
    if entries and all(counts[i] == len(c.block_paths) for i, c in enumerate(chains)):
        # every block is in host memory and budget is left: take entries out of the pool, from the start of the
        # chains (the blocks a newcomer needs first), so that their blocks stay for the whole run and are not
        # read again at each change of DiT
        while entries:
            extra = sum(sorted(host_nbytes[p] for p in entries[0])[:-1])
            if used + extra > budget:
                break
            used += extra
            host += entries.pop(0)
    on_host = set(host) | {p for e in entries for p in e}
    disk = [p for chain in chains for p in chain.block_paths if p not in on_host]
    host.sort(key=[p for c in chains for p in c.block_paths].index)
    pool = None
    if entries:
        pool = HostPoolChoice(
            alternating,
            tuple(tuple(e) for e in entries),
            tuple(max(host_nbytes[p] for p in e) for e in entries),
            MappingProxyType({m: tuple(p for c in chains if c.component == m for p in c.block_paths) for m in alternating}),
        )
    if not disk and pool is None:
        reason = f"host_budget_gb={budget_gb:g} holds every streamed block ({total / GB:.3g} GB)"
    else:
        reason = (
            f"host_budget_gb={budget_gb:g} holds {used / GB:.3g} of {total / GB:.3g} GB of streamed blocks; the host "
            "blocks are a fixed set spread through each chain, the others are read from disk at every use"
        )
        if pool is not None:
            reason += (
                f"; {' and '.join(alternating)} run one after the other and share a host pool of "
                f"{pool.nbytes / GB:.3g} GB (the one not running holds no host memory)"
            )
    return HostTierChoice(budget, tuple(host), tuple(disk), used, reason, pool)


def _chains_of(comp: ResolvedComponent) -> list[list[str]]:
    """Prefetch chains: one through the component's own stacks, one per `offload_submodules` stack."""
    main = main_chain(comp)
    chains = [main] if main else []
    chains += [list(s.block_paths) for s in comp.stacks if s.own_chain]
    return chains


def _choose_residency(
    plan: ResolvedOffloadPlan, block_slot_nbytes: Mapping[str, int], budget: DeviceBudget | None
) -> dict[str, ResidencyChoice]:
    choices: dict[str, ResidencyChoice] = {}
    auto = []
    for comp in plan.streamed:
        chain = main_chain(comp)
        if comp.category != "dit" or comp.resident_layers == 0:
            choices[comp.path] = ResidencyChoice((), len(chain), "streams every block")
        elif not comp.resident_allowed:  # the resolver refuses an int here; "auto" quietly keeps nothing
            choices[comp.path] = ResidencyChoice((), len(chain), "auto: not declared in resident_dit_paths")
        elif comp.resident_layers == "auto":
            auto.append(comp)
        else:
            n = int(comp.resident_layers)
            reason = f"resident_layers={n} (leading blocks)"
            if n >= len(chain):
                reason = f"resident_layers={n} keeps every one of the {len(chain)} blocks resident"
            choices[comp.path] = ResidencyChoice(tuple(chain[:n]), len(chain), reason)
    if auto:
        if budget is None:
            raise ValueError('place_blocks: a DiT asks for resident_layers "auto" but no device budget was given')
        choices.update(_choose_auto(plan, auto, block_slot_nbytes, budget))
    return choices


def _choose_auto(
    plan: ResolvedOffloadPlan, auto: list[ResolvedComponent], block_slot_nbytes: Mapping[str, int], budget: DeviceBudget
) -> dict[str, ResidencyChoice]:
    streamed = plan.streamed
    # the ring is sized before residency is known: for the largest block that could stream (an upper bound)
    depth = max((c.prefetch_depth for c in streamed), default=1)
    slots_bytes = (depth + 1) * align_slot(max((block_slot_nbytes[p] for c in streamed for s in c.stacks for p in s.block_paths), default=0))
    non_block = sum(c.total_bytes - (c.block_bytes if c.action == "stream" else 0) for c in plan.components if c.action != "on_demand")
    available = budget.nbytes - slots_bytes - non_block
    chains = {c.path: main_chain(c) for c in auto}
    sizes = {c.path: {p: n for s in c.stacks for p, n in zip(s.block_paths, s.block_bytes)} for c in auto}

    def resident_nbytes(counts: list[int]) -> int:
        picked = [(c.path, i) for c, n in zip(auto, counts) for i in spread_indices(len(chains[c.path]), n)]
        return sum(sizes[path][chains[path][i]] for path, i in picked)

    fits = _hand_out([len(chains[c.path]) for c in auto], lambda counts: resident_nbytes(counts) <= available)
    counts = {c.path: n for c, n in zip(auto, fits)}
    out = {}
    for comp in auto:
        chain = chains[comp.path]
        picked = tuple(chain[i] for i in spread_indices(len(chain), counts[comp.path]))
        reason = (
            f"auto: budget {budget.nbytes / GB:.3g} GB ({budget.source}) - slots {slots_bytes / GB:.3g} GB - non-block "
            f"modules {non_block / GB:.3g} GB leaves {max(available, 0) / GB:.3g} GB; resident blocks spread through "
            "the stack"
        )
        if not picked and chain:
            needed = slots_bytes + non_block + sizes[comp.path][chain[spread_indices(len(chain), 1)[0]]]
            # rounded up, so that the figure given back as device_budget_gb is always enough
            reason += f"; keeping one block resident needs a budget of at least {_gb_rounded_up(needed):g} GB ({needed} bytes)"
        out[comp.path] = ResidencyChoice(picked, len(chain), reason)
    return out


def _hand_out(lengths: list[int], fits: Callable[[list[int]], bool]) -> list[int]:
    """Blocks per chain, handed out one at a time to the chain with the smallest fraction, until one does not fit
    (`fits`): that stops the hand-out, though a smaller block of another chain might still fit."""
    counts = [0] * len(lengths)
    while True:
        candidates = [i for i, n in enumerate(lengths) if counts[i] < n]
        if not candidates:
            return counts
        i = min(candidates, key=lambda i: counts[i] / lengths[i])
        grown = counts[:i] + [counts[i] + 1] + counts[i + 1 :]
        if not fits(grown):
            return counts
        counts = grown


def _gb_rounded_up(nbytes: int, digits: int = 4) -> float:
    """`nbytes` in GB to `digits` significant digits, rounded up: a stated minimum given back is enough."""
    if nbytes <= 0:
        return 0.0
    gb = nbytes / GB
    scale = 10 ** (digits - 1 - math.floor(math.log10(gb)))
    return math.ceil(gb * scale) / scale


def spread_indices(num_blocks: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(num_blocks) (count <= num_blocks)."""
    if count <= 0:
        return []
    if count >= num_blocks:
        return list(range(num_blocks))
    return sorted({(2 * i + 1) * num_blocks // (2 * count) for i in range(count)})
