"""Composing each streamed component's host store from its resolved component: the first `StoreKind` that
builds wins; with `host_budget_gb` the stores become the host side of one `TieredHostStore` over one disk store.
float8 and lossless storage are forms, not stores: one set per component (`StoreContext.forms`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerstream.plan.placement import Placement
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan
from layerstream.runtime.contracts import HostStore, StoredForm
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.float8 import STORAGE_DTYPES, float8_forms
from layerstream.runtime.forms.lossless import LOSSLESS, lossless_forms
from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.forms.segments import FormsByLayout
from layerstream.runtime.stores.disk.disk_store import DiskHostStore
from layerstream.runtime.stores.local_store import LocalHostStore
from layerstream.runtime.stores.tiered_store import TieredHostStore


@dataclass(frozen=True)
class StoreContext:
    """What building a store may need beyond its component: handed down by the composition root."""

    plan: ResolvedOffloadPlan
    device: torch.device
    components: Mapping[str, nn.Module]
    process_group: Any = None
    spill_root: Path | None = None  # `disk_dir`, or the cache's folder; needed with `host_budget_gb`
    simulated_disk_gbps: float | None = None

    @cached_property
    def forms(self) -> dict[str, FormsByLayout]:
        """The float8 or lossless forms of each streamed component with `storage_dtype`, by component path."""
        out = {}
        for comp in self.plan.streamed:
            if comp.storage_dtype in STORAGE_DTYPES:
                out[comp.path] = float8_forms(self.components[comp.path], STORAGE_DTYPES[comp.storage_dtype])
            elif comp.storage_dtype == LOSSLESS:
                out[comp.path] = lossless_forms()
        return out

    @cached_property
    def form_of(self) -> Callable[[BlockLayout], StoredForm]:
        """The form a block is kept in; holding the forms only, not the components (a dropped pipeline goes)."""
        forms = self.forms
        component_of_block = {p: c.path for c in self.plan.streamed for stack in c.stacks for p in stack.block_paths}

        def form_of(layout: BlockLayout) -> StoredForm:
            component_forms = forms.get(component_of_block.get(layout.path, ""))
            return component_forms.form(layout) if component_forms is not None else PackedForm(layout)

        return form_of


@dataclass(frozen=True)
class StoreKind:
    """One kind of host store (see the module docstring)."""

    name: str
    applies: Callable[[ResolvedComponent], bool]
    build: Callable[[ResolvedComponent, StoreContext], HostStore | None]
    shared: bool = False  # one store for every component of this kind


LOCAL_KIND = StoreKind("local", lambda c: True, lambda c, ctx: LocalHostStore(ctx.form_of), shared=True)


@dataclass
class ComponentStores:
    """The store of each streamed component, and each distinct store once (components may share one)."""

    by_component: dict[str, HostStore]
    distinct: list[HostStore] = field(default_factory=list)

    def __post_init__(self):
        for store in self.by_component.values():
            if all(store is not s for s in self.distinct):
                self.distinct.append(store)

    def __getitem__(self, component: str) -> HostStore:
        return self.by_component[component]

    def __iter__(self) -> Iterator[HostStore]:
        return iter(self.distinct)

    def slot_and_host_nbytes(self, plan: ResolvedOffloadPlan, layouts: Mapping[str, BlockLayout]) -> tuple[dict[str, int], dict[str, int]]:
        """Per streamable block: the slot bytes and the host bytes its component's store gives it (pure)."""
        slot, host = {}, {}
        for comp in plan.streamed:
            store = self.by_component[comp.path]
            for stack in comp.stacks:
                for path in stack.block_paths:
                    slot[path] = store.slot_nbytes(layouts[path])
                    host[path] = store.host_nbytes(layouts[path])
        return slot, host

    def place_(self, placement: Placement) -> None:
        for store in self.distinct:
            store.place_(placement)

    def layouts_by_store(self, placement: Placement, layouts: Mapping[str, BlockLayout]) -> list[tuple[HostStore, list[BlockLayout]]]:
        """Each distinct store with the layouts of the streamed blocks it will hold, in chain order."""
        out: list[tuple[HostStore, list[BlockLayout]]] = [(store, []) for store in self.distinct]
        index = {id(store): i for i, store in enumerate(self.distinct)}
        for chain in placement.chains:
            mine = out[index[id(self.by_component[chain.component])]][1]
            mine.extend(layouts[p] for p in chain.block_paths)
        return out

    def report_failure_(self, error: BaseException) -> None:
        for store in self.distinct:
            store.report_failure_(error)


def compose_stores(ctx: StoreContext, kinds: Sequence[StoreKind], *, disk_tier: bool = True) -> ComponentStores:
    """The store of every streamed component; `disk_tier=False` leaves the tier out (for a plan only shown)."""
    built: dict[str, HostStore] = {}  # shared kind -> its store
    by_component: dict[str, HostStore] = {}
    for comp in ctx.plan.streamed:
        by_component[comp.path] = _store_for(comp, ctx, kinds, built)
    if disk_tier and ctx.plan.config.host_budget_gb is not None:
        by_component = _with_disk_tier(by_component, ctx)
    return ComponentStores(by_component)


def _store_for(comp: ResolvedComponent, ctx: StoreContext, kinds: Sequence[StoreKind], built: dict[str, HostStore]) -> HostStore:
    for kind in kinds:
        if not kind.applies(comp):
            continue
        if kind.shared and kind.name in built:
            return built[kind.name]
        store = kind.build(comp, ctx)
        if store is None:
            continue  # the kind declined (allgather over a group of one): the next one serves
        if kind.shared:
            built[kind.name] = store
        return store
    raise AssertionError(f"no store kind serves {comp.path} (the local kind serves every component)")


def _with_disk_tier(by_component: dict[str, HostStore], ctx: StoreContext) -> dict[str, HostStore]:
    """Every component's store as the host side of one tiered store over one disk store (counted once)."""
    assert ctx.spill_root is not None, "host_budget_gb needs a spill folder"
    host_of = {
        path: by_component[comp.path] for comp in ctx.plan.streamed for stack in comp.stacks for path in stack.block_paths
    }
    disk = DiskHostStore(
        ctx.spill_root,
        simulated_gbps=ctx.simulated_disk_gbps,
        form_of=lambda layout: host_of[layout.path].stored_form(layout),
        part_of=lambda layout: host_of[layout.path].disk_part(layout),
    )
    tiered = TieredHostStore(host_of, disk)
    return {path: tiered for path in by_component}
