"""Layer mode: stream the placement's blocks through one slot ring, every other tensor on the device.
`apply_layer_mode`, the apply step of `enable_offload`, opens the ring and the copy engine, moves every
non-streamed tensor to the device, stages the streamed blocks into their stores, hooks them and commits the
stores, each step pushing its undo; `LayerModeBackend` is what the handle drives afterwards.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from layerstream.plan.placement import Placement
from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.runtime.streaming.block_call import BlockCall
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.torch_contract.lora import LoraSupport, install_lora_support
from layerstream.runtime.streaming.ownership import CallOwnership
from layerstream.runtime.reporting.progress import StagingProgress
from layerstream.runtime.contracts import CopyEngine, HostStore, StoredBlock, StoreStats
from layerstream.runtime.stores.compose import ComponentStores
from layerstream.runtime.torch_contract.state_dict import install_state_dict_hooks
from layerstream.runtime.reporting.stats import ComponentStats, OffloadStats, OffloadTrace, TraceInterval
from layerstream.runtime.streaming.streamer import BlockCounters, BlockStreamer, StreamedBlock
from layerstream.runtime.streaming.wrapping import MethodWrapper
from layerstream.runtime.packing.tensors import device_bytes, module_device, move_tensors_, unmap_tensors_
from layerstream.runtime.modes.hooks import PIPELINE, HookSet
from layerstream.runtime.modes.undo import UndoStack
from layerstream.wording import format_bytes

logger = logging.getLogger(__name__)

EngineFactory = Callable[[torch.device, int], CopyEngine]
# what the store reports that the totals take as they are
_STORE_FIGURES = (
    "disk_bytes_read", "disk_stall_seconds", "host_pool_bytes", "disk_staging_bytes", "lossless_stored_bytes",
    "lossless_decoded_bytes",
)  # fmt: skip


def apply_layer_mode(
    *,
    plan: ResolvedOffloadPlan,
    placement: Placement,
    components: Mapping[str, nn.Module],
    block_modules: Mapping[str, nn.Module],
    layouts: Mapping[str, BlockLayout],
    stores: ComponentStores,
    device: torch.device,
    engine_factory: EngineFactory,
    undo: UndoStack,
) -> LayerModeBackend:
    """Apply the placement; `layouts` and `block_modules` cover every streamed block. Undo steps go onto `undo`."""
    slot_buffers, engine = _open_slot_ring(placement, device, engine_factory, undo)
    moved_by_own_to = _place_components_(plan, placement, components, device, undo)
    pin = engine if engine is not None and plan.config.pin_memory else None
    stored = _stage_blocks(plan, placement, layouts, stores, device, pin, undo)
    if device.type == "cpu":
        _unmap_resident_(plan, placement, components, undo)
    counters = {comp.path: BlockCounters() for comp in plan.streamed}
    ownership = CallOwnership(plan.pipeline_class)
    streamer = _build_streamer(placement, stored, block_modules, counters, engine, slot_buffers, ownership)
    hooks = HookSet()
    undo.push(hooks.remove_all_)
    lora = _install_hooks(plan, components, streamer, device, hooks) if streamer is not None else None
    for store in stores:
        store.commit_()  # sharded: every rank staged; only now may any rank drop its original weights
        if streamer is not None:
            store.follow_order_(streamer.successor, len(streamer.blocks))  # a store that reads ahead follows it
    logger.info(
        "layerwise offload on %s: %d streamed blocks, %d slots of %s",
        plan.pipeline_class, len(stored), placement.num_slots, format_bytes(placement.slot_nbytes),
    )
    return LayerModeBackend(
        plan, placement, device, components, streamer, engine, stores, hooks, counters, lora, ownership, moved_by_own_to
    )


def _open_slot_ring(placement: Placement, device: torch.device, engine_factory: EngineFactory, undo: UndoStack):
    """(the slot buffers, the copy engine or None when nothing streams)."""
    with torch.inference_mode(False):  # slots are bound as parameters: never inference tensors
        slot_buffers = [torch.empty(placement.slot_nbytes, dtype=torch.uint8, device=device) for _ in range(placement.num_slots)]
    engine = engine_factory(device, placement.num_slots) if placement.num_slots > 0 else None
    if engine is not None:
        engine.guard_slots_(slot_buffers)  # the copy stream writes them: freed only after its copies have run
        undo.push(engine.close)
    return slot_buffers, engine


def _place_components_(
    plan, placement: Placement, components, device: torch.device, undo: UndoStack
) -> dict[str, torch.device]:
    """Every tensor that does not stream to the device; a component with its own `to()` (which may stage weights)
    through it, once: returns those components' paths -> where they were."""
    streamed_paths = set(placement.streamed_block_paths)
    moved_by_own_to: dict[str, torch.device] = {}
    for comp in plan.components:
        module = components[comp.path]
        if comp.on_demand:
            module.offload_to_cpu()
            undo.push(module.load_to_device)
        if comp.action == "on_demand":
            continue
        if comp.own_to is not None:
            moved_by_own_to[comp.path] = original = module_device(module)
            undo.push(lambda m=module, d=original: m.to(d))
            module.to(device)
            continue
        move_tensors_(module, comp.path, streamed_paths if comp.action == "stream" else set(), device, undo.push)
    return moved_by_own_to


def _stage_blocks(plan, placement: Placement, layouts, stores: ComponentStores, device, pin, undo: UndoStack) -> dict[str, StoredBlock]:
    """Every streamed block into its component's store, in chain order, with a progress bar."""
    for store in stores:
        undo.push(store.rollback_)  # before the first stage: a store can fail half-way through staging
    stored: dict[str, StoredBlock] = {}
    progress = StagingProgress(
        f"staging {plan.pipeline_class} into the host store", sum(layouts[p].nbytes for p in placement.streamed_block_paths),
        len(placement.streamed_block_paths),
    )
    for chain in placement.chains:
        for path in chain.block_paths:
            stored[path] = stores[chain.component].stage_(layouts[path], device, pin)
            progress.advance(layouts[path].nbytes)
    progress.close(sum(store.stats().bytes_read_from_files for store in stores))
    return stored


def _unmap_resident_(plan, placement: Placement, components, undo: UndoStack) -> None:
    """Resident weights that still view the checkpoint's mapping get memory of their own (as a move does)."""
    files = MappedFiles.snapshot()
    if not len(files):
        return
    streamed_paths = set(placement.streamed_block_paths)
    reader = FileReader()
    try:
        for comp in plan.components:
            if comp.action != "on_demand" and comp.own_to is None:  # a component moving itself is left to its to()
                skip = streamed_paths if comp.action == "stream" else set()
                unmap_tensors_(components[comp.path], comp.path, skip, files, reader, undo.push)
    finally:
        reader.close()
        files.close()


def _build_streamer(placement: Placement, stored, block_modules, counters, engine, slot_buffers, ownership) -> BlockStreamer | None:
    blocks: list[StreamedBlock] = []
    chains: list[list[int]] = []
    for chain in placement.chains:
        indices = []
        for path in chain.block_paths:
            block = StreamedBlock(len(blocks), stored[path], chain.component, block_modules[path], counters[chain.component], chain.prefetch_depth)
            blocks.append(block)
            indices.append(block.index)
        chains.append(indices)
    return BlockStreamer(blocks, chains, engine, slot_buffers, ownership) if blocks else None


def _install_hooks(plan, components, streamer: BlockStreamer, device: torch.device, hooks: HookSet) -> LoraSupport:
    """Block calls, component wrappers, LoRA entry points and state-dict hooks, each recorded by name."""
    for block in streamer.blocks:
        binding = BlockCall(streamer, block)
        hooks.add(block.path, "block_call", "binds the block to a device slot around each call", binding.remove)
    path_of = {id(components[c.path]): c.display_path for c in plan.streamed}
    for comp in plan.streamed:
        # a method wrapper, not hooks: a Ctrl-C must not leave the model owned by a dead call (torch skips hooks)
        wrapper = MethodWrapper(components[comp.path], "forward", streamer.enter, streamer.exit)
        why = "one thread at a time; frees a block a Ctrl-C left bound"
        hooks.add(comp.display_path, "component_call", why, wrapper.remove)
    streamed_components = {c.path: components[c.path] for c in plan.streamed}
    lora, lora_wrappers = install_lora_support(streamer, streamed_components, device, exact_unfuse=plan.config.lora_exact_unfuse)
    for wrapper in lora_wrappers:
        hooks.add(path_of[id(wrapper.module)], f"lora.{wrapper.name}", "binds the blocks' host weights while LoRA changes them", wrapper.remove)
    display = {c.path: c.display_path for c in plan.streamed}
    for path, name, what, handle in install_state_dict_hooks(streamer, streamer.blocks, streamed_components, on_block_loaded=lora.forget_block_):
        hooks.add(display.get(path, path), name, what, handle.remove)
    return lora


class LayerModeBackend:
    """A running layer mode: the streamer, its engine and stores, and their teardown."""

    def __init__(
        self, plan, placement, device, components, streamer, engine, stores, hooks, counters, lora=None, ownership=None,
        moved_by_own_to: dict[str, torch.device] | None = None,
    ):  # fmt: skip
        self.plan = plan
        self.ownership: CallOwnership = ownership if ownership is not None else CallOwnership(plan.pipeline_class)
        self.placement = placement
        self.device = device
        self.components: Mapping[str, nn.Module] = components
        self._streamer: BlockStreamer | None = streamer
        self._engine: CopyEngine | None = engine
        self._stores: list[HostStore] = list(stores)
        self.hooks: HookSet = hooks  # everything installed on the pipeline, by name
        self._counters: dict[str, BlockCounters] = counters
        self._lora: LoraSupport | None = lora
        self.moved_by_own_to: dict[str, torch.device] = dict(moved_by_own_to or {})  # path -> where enable found it

    def wrap_pipeline_(self, pipeline) -> None:
        """Wrap the pipeline's own LoRA entry points (`load_lora_weights`, `fuse_lora` ...)."""
        if self._lora is None or any(pipeline is m for m in self.components.values()):
            return
        for wrapper in self._lora.wrap_(pipeline):
            self.hooks.add(PIPELINE, f"lora.{wrapper.name}", "binds the blocks' host weights while LoRA changes them", wrapper.remove)

    def release_when_dropped(self) -> Callable[[], None]:
        """What frees a dropped pipeline's threads and host memory (holding nothing that keeps it alive)."""
        slots = self._streamer.slot_buffers if self._streamer is not None else []
        return functools.partial(release_dropped, self._engine, list(self._stores), slots)

    @property
    def streamer(self) -> BlockStreamer | None:
        return self._streamer  # None once disabled

    def stats(self) -> OffloadStats:
        streamer = self._streamer
        per: dict[str, ComponentStats] = {}
        for comp in self.plan.components:
            module = self.components.get(comp.path)
            if module is None or comp.action == "on_demand":
                continue
            mine = [b for b in streamer.blocks if b.component == comp.path] if streamer else []
            host = [b.host for b in mine]
            pre_fuse = self._lora.pre_fuse_bytes if self._lora is not None else {}
            counters = self._counters.get(comp.path) or BlockCounters()
            per[comp.display_path] = ComponentStats(
                **{name: getattr(counters, name) for name in BlockCounters.__slots__},
                device_bytes=device_bytes(module, self.device),
                host_bytes=sum(h.host_bytes for h in host) + sum(pre_fuse.get(b.index, 0) for b in mine),
                pinned_host_bytes=sum(h.host_bytes for h in host if h.pinned),
                num_streamed_blocks=len(host),
                num_resident_blocks=len(self.placement.resident_block_paths(comp.path)),
            )
        totals = {f: sum(getattr(s, f) for s in per.values()) for f in ComponentStats.__dataclass_fields__}
        totals["device_bytes"] += self.placement.ring_nbytes
        own = sum((store.stats() for store in self._stores), StoreStats())  # what each store keeps beside its blocks
        totals["host_bytes"] += own.host_bytes
        totals["pinned_host_bytes"] += own.pinned_host_bytes
        return OffloadStats(
            **totals,
            per_component=MappingProxyType(per),
            num_slots=self.placement.num_slots,
            slot_bytes=self.placement.ring_nbytes,
            max_materialized_blocks=streamer.max_materialized if streamer else 0,
            engine=self._engine.kind if self._engine is not None else "",
            host_bytes_from_files=own.bytes_read_from_files,
            **{name: getattr(own, name) for name in _STORE_FIGURES},
            residency=MappingProxyType({self.plan.component(p).display_path: c.describe() for p, c in self.placement.residency.items()}),
            host_budget=self.placement.host_budget.describe() if self.placement.host_budget is not None else "",
        )

    def block_transfers(self) -> dict[str, int]:
        if self._streamer is None:
            return {}
        return {b.path: b.num_transfers for b in self._streamer.blocks}

    def trace(self) -> OffloadTrace:
        intervals: list[TraceInterval] = []
        engine, streamer = self._engine, self._streamer
        if engine is None or streamer is None:
            return OffloadTrace(())
        component_of = {b.path: b.component for b in streamer.blocks}
        for r in engine.copy_records():
            intervals.append(TraceInterval("copy", r.label, r.start, r.end, r.slot, component=component_of.get(r.label, "")))
        for r in list(streamer.compute_records):
            wait, start, end = engine.resolve(r.wait_start), engine.resolve(r.start), engine.resolve(r.end)
            intervals.append(
                TraceInterval(
                    "compute", r.label, start, end, r.slot, stall=start - wait, sync_load=r.sync_load,
                    component=component_of.get(r.label, ""),
                )
            )
        intervals.sort(key=lambda i: (i.start, i.lane))
        return OffloadTrace(tuple(intervals))

    def reset_trace(self) -> None:
        if self._engine is not None:
            self._engine.clear_records()
        if self._streamer is not None:
            self._streamer.compute_records.clear()

    def disable(self) -> None:
        """Teardown in the only safe order: hooks off, wait for every copy in flight (closing the engine), give the
        blocks their tensors back and free the stores, forget the slot ring, then hand residency back."""
        self.hooks.remove_all_()
        if self._engine is not None:
            self._engine.close()  # waits for in-flight copies: they read host buffers restore_ frees below
        for store in self._stores:
            store.restore_(self.device)  # under allgather a collective: every rank calls disable()
        self._stores = []
        if self._streamer is not None:
            for block in self._streamer.blocks:
                block.views.clear()  # cached views keep the slots' storage alive
            self._streamer.slot_buffers.clear()
        self._streamer = None
        self._engine = None
        for comp in self.plan.components:
            if comp.on_demand:
                self.components[comp.path].load_to_device()  # its blocks are whole again: the pipeline's turn
        for path, original in self.moved_by_own_to.items():
            self.components[path].to(original)
        self.moved_by_own_to = {}  # a second disable() moves nothing


def release_dropped(engine: CopyEngine | None, stores: list[HostStore], slot_buffers: list[torch.Tensor]) -> None:
    """Stop the engine of a pipeline dropped without `disable()` (its copies read host buffers and write the
    slots, held here until then), then free every store; from the garbage collector, errors are logged."""
    try:
        if engine is not None:
            engine.close()
    except Exception:  # noqa: BLE001 - a finalizer has no caller to raise to
        logger.exception("closing the copy engine of a dropped pipeline failed")
    for store in stores:
        try:
            store.release_()
        except Exception:  # noqa: BLE001
            logger.exception("freeing the host store of a dropped pipeline failed")
    slot_buffers.clear()
    logger.info("a pipeline was dropped without disable(): its copy engine and %d host store(s) were released", len(stores))
