"""`enable_offload`: plan, check, then apply; undo everything if applying fails.

This is where the layers meet: the config is read and resolved into a plan (`plan/`), the host store of each
streamed component is chosen (the local packed store, or the sharded allgather store from `distributed/`), the
placement decides where every block goes (with `host_budget_gb`, the blocks it puts on disk go to a disk store
beside the host store: `with_disk_tier`), and a mode backend of `runtime/` applies it. The handle it returns
reports and undoes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from layerstream.config.offload_config import OffloadConfig, parse_offload_config
from layerstream.errors import LayerstreamError, OffloadError
from layerstream.plan.placement import Placement, needs_device_budget, place_blocks, read_device_budget
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan, lookup
from layerstream.runtime.cast_store import STORAGE_DTYPES, CastHostStore
from layerstream.runtime.copy_engine import make_copy_engine
from layerstream.runtime.disk_store import DiskHostStore
from layerstream.runtime.handle import OffloadHandle
from layerstream.runtime.layer_mode import EngineFactory, apply_layer_mode, distinct_stores
from layerstream.runtime.layout import BlockLayout
from layerstream.runtime.module_mode import apply_module_mode
from layerstream.runtime.ownership import own_pipeline_calls_
from layerstream.runtime.packed_store import PackedHostStore
from layerstream.runtime.protocols import HostStore
from layerstream.runtime.guards import guard_module_, guard_pipeline_
from layerstream.runtime.safety import check_no_foreign_offload, check_no_shared_block_tensors, check_packable_block_tensors
from layerstream.runtime.tensors import named_tensors
from layerstream.runtime.tiered_store import TieredHostStore
from layerstream.runtime.undo import UndoStack

logger = logging.getLogger(__name__)

_MARK = "_layerstream_offload"  # attribute set on each component module while offload is enabled

StoreFactory = Callable[[str], HostStore]
"""Given a streamed component's path, the host store its blocks go to (components may share one store)."""

RESOURCE_ERRORS = (torch.OutOfMemoryError, MemoryError, KeyboardInterrupt)
"""Errors that come out of a failed enable as themselves (after the rollback), never wrapped."""


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def enable_offload(
    pipeline: Any,
    config: OffloadConfig | dict | str,
    device: torch.device | str | None = None,
    *,
    simulated_link_gbps: float | None = None,
    simulated_disk_gbps: float | None = None,
    trace: bool = False,
    process_group=None,
    engine_factory: EngineFactory | None = None,
    store_factory: StoreFactory | None = None,
) -> OffloadHandle:
    """Enable offload on `pipeline` as `config` selects and return the handle that reports and undoes it.

    `device` defaults to the current CUDA device, else the CPU. `simulated_disk_gbps` (CPU only) makes every read
    of the disk tier (`host_budget_gb`) last as long as it would on a disk of that bandwidth. `simulated_link_gbps` (CPU only) throttles the
    copy thread to a link of that bandwidth. `trace` records accelerator timing events for `handle.trace()`
    (the CPU engine always records). `engine_factory(device, num_slots)` and `store_factory(component_path)`
    replace the copy engine and the host stores (instrumentation: wrap the defaults to observe or inject).
    Enabling is a transaction: on any error the pipeline is left as it was; out-of-memory errors and
    `KeyboardInterrupt` come out as themselves, other failures while applying as `OffloadError`.

    Components with `weight_transfer: "allgather"` shard their blocks' host bytes over `process_group` (default:
    the default group of torch.distributed); every rank of it must call `enable_offload` (and later `disable`)
    with the same model and config. See layerstream.distributed.collectives for the order of collectives and
    what happens when a rank fails.
    """
    config = parse_offload_config(config)
    from layerstream.plan.resolver import resolve_offload_plan  # the resolver is the only reader of plans

    plan = resolve_offload_plan(pipeline, config)
    device = _check_device(device, simulated_link_gbps)
    _check_device(device, simulated_disk_gbps, "simulated_disk_gbps")
    components = {c.path: lookup(pipeline, c.path) for c in plan.components}
    _check_components(plan, components)
    if engine_factory is None:
        def engine_factory(device, num_slots):
            return make_copy_engine(device, num_slots, link_gbps=simulated_link_gbps, timing=trace)

    undo = UndoStack()
    if config.mode == "module":
        try:
            backend = apply_module_mode(plan, components, device, undo)
        except BaseException as e:
            undo.unwind()
            _raise_after_rollback(plan, e)
        return _commit_handle(plan, device, backend, components, pipeline=pipeline)

    if store_factory is None:
        stores = store_factory_for(plan, device, process_group, components=components)
    else:
        stores = store_factory
    component_stores = {comp.path: stores(comp.path) for comp in plan.streamed}
    try:
        layouts = block_layouts(pipeline, plan, device)
        placement = place_for(plan, layouts, component_stores, device)
        component_stores = with_disk_tier(component_stores, placement, config.disk_dir, simulated_disk_gbps)
        block_modules = {p: lookup(pipeline, p) for p in placement.streamed_block_paths}
        check_no_shared_block_tensors(plan.pipeline_class, components, block_modules)
    except BaseException as e:
        for store in distinct_stores(component_stores.values()):
            store.report_failure_(e)
        raise
    for store in distinct_stores(component_stores.values()):
        mine = [layouts[p] for c in placement.chains if component_stores[c.component] is store for p in c.block_paths]
        store.check_layouts_(mine, placement.slot_nbytes)

    try:
        backend = apply_layer_mode(
            plan=plan,
            placement=placement,
            components=components,
            block_modules=block_modules,
            layouts={p: layouts[p] for p in placement.streamed_block_paths},
            stores=component_stores,
            device=device,
            engine_factory=engine_factory,
            undo=undo,
        )
    except BaseException as e:
        undo.unwind()
        _raise_after_rollback(plan, e)
    return _commit_handle(plan, device, backend, components, block_modules, pipeline=pipeline)


def block_layouts(pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device) -> dict[str, BlockLayout]:
    """The packed layout of every streamable block (pure: reads tensors' addresses and shapes, moves nothing).
    Raises `UnsupportedTensorError` for a block holding a tensor that cannot be packed."""
    blocks = {p: lookup(pipeline, p) for comp in plan.streamed for stack in comp.stacks for p in stack.block_paths}
    for path, block in blocks.items():
        check_packable_block_tensors(plan.pipeline_class, path, block)
    return {p: BlockLayout(p, block, device) for p, block in blocks.items()}


def place_for(
    plan: ResolvedOffloadPlan, layouts: Mapping[str, BlockLayout], stores: Mapping[str, HostStore], device: torch.device
) -> Placement:
    """The placement of `plan` on `device`, with each block's slot bytes as its store lays it out."""
    slot_nbytes = {p: stores[comp.path].slot_nbytes(layouts[p]) for comp in plan.streamed for s in comp.stacks for p in s.block_paths}
    budget = read_device_budget(plan, device, free_device_bytes(device)) if needs_device_budget(plan) else None
    return place_blocks(plan, slot_nbytes, budget)


def with_disk_tier(
    stores: Mapping[str, HostStore], placement: Placement, disk_dir: str | None, disk_gbps: float | None = None
) -> dict[str, HostStore]:
    """Where the placement puts blocks on disk (`host_budget_gb`), each component's store becomes a tiered store:
    its own store for the host blocks, one disk store for the disk blocks. Decided after the placement, which
    needs only the stores' slot bytes; the host store of the tiered one lays blocks out the same way."""
    tier = placement.host_tier
    if tier is None or not tier.from_disk_paths:
        return dict(stores)
    disk = DiskHostStore(disk_dir, simulated_gbps=disk_gbps, pool=tier.pool)
    tiered: dict[int, TieredHostStore] = {}
    for store in stores.values():
        if id(store) not in tiered:
            tiered[id(store)] = TieredHostStore(store, disk, tier)
    return {path: tiered[id(store)] for path, store in stores.items()}


def plan_placement(pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device | None = None) -> Placement:
    """The placement `enable_offload` would use on `device`, for one process (every block in the local store);
    moves nothing. Raises `OffloadError` where residency "auto" has no budget to read."""
    device = _check_device(device, None)
    local = PackedHostStore()
    stores = {c.path: _low_precision_store(c, lookup(pipeline, c.path)) or local for c in plan.streamed}
    return place_for(plan, block_layouts(pipeline, plan, device), stores, device)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device; None where there is none to read."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def store_factory_for(
    plan: ResolvedOffloadPlan,
    device: torch.device,
    process_group=None,
    *,
    components: Mapping[str, nn.Module] | None = None,
) -> StoreFactory:
    """The default stores: one local packed store, one sharded store over the group for the components that
    ask for `weight_transfer: "allgather"` (a group of one gets the local store: plain copies), and a
    low-precision store per component with a `storage_dtype` (`components` maps their paths to the modules)."""
    local = PackedHostStore()
    cast: dict[str, HostStore] = {}
    for comp in plan.streamed:
        if comp.storage_dtype is not None:
            assert components is not None, "storage_dtype needs the component modules"
            cast[comp.path] = _low_precision_store(comp, components[comp.path])
    sharded: HostStore | None = None
    if any(c.weight_transfer == "allgather" for c in plan.streamed):
        # torch.distributed is imported only when a component asks for it
        from layerstream.distributed.collectives import open_block_gather
        from layerstream.distributed.sharded_store import ShardedHostStore

        gather = open_block_gather(plan.pipeline_class, device, process_group)
        sharded = ShardedHostStore(gather) if gather is not None else None

    def store_for(path: str) -> HostStore:
        if path in cast:
            return cast[path]
        if sharded is not None and plan.component(path).weight_transfer == "allgather":
            return sharded
        return local

    return store_for


def _low_precision_store(comp: ResolvedComponent, module: nn.Module) -> HostStore | None:
    """The component's own low-precision store where it asks for a `storage_dtype` (else None)."""
    if comp.storage_dtype is None:
        return None
    return CastHostStore(module, STORAGE_DTYPES[comp.storage_dtype])


def _check_device(device, simulated_link_gbps, name: str = "simulated_link_gbps") -> torch.device:
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"device {device}: CUDA is not available in this torch ({torch.__version__}); use the CPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if simulated_link_gbps is not None and device.type != "cpu":
        raise OffloadError(f"{name} = {simulated_link_gbps!r} applies only to the CPU device, not {device}")
    if simulated_link_gbps is not None and (isinstance(simulated_link_gbps, bool) or not simulated_link_gbps > 0):
        raise OffloadError(f"{name} = {simulated_link_gbps!r} is not valid; expected a number > 0")
    return device


def _check_components(plan: ResolvedOffloadPlan, components: Mapping[str, nn.Module]) -> None:
    _check_not_enabled(plan, components)
    check_no_foreign_offload(plan.pipeline_class, components)
    for comp in plan.components:
        if comp.action in ("stream", "swap", "resident"):
            for name, t in named_tensors(components[comp.path]):
                if t.device.type == "meta":
                    raise OffloadError(
                        f"{plan.pipeline_class}: {comp.display_path}.{name} is on the meta device (weights not loaded)"
                    )


def _check_not_enabled(plan: ResolvedOffloadPlan, components: Mapping[str, nn.Module]) -> None:
    """Refuse to enable offload over an earlier enable, naming what that enable did.

    Every component of a plan is marked, the resident ones too, so a pipeline enabled before has all of them
    marked: the first marked component in plan order (often the resident vae) says nothing about the problem.
    """
    marks = [(comp.display_path, getattr(components[comp.path], _MARK, None)) for comp in plan.components]
    handles = [handle for _, handle in marks if handle is not None]
    if not handles:
        return
    handle = handles[0]
    marked = [path for path, mark in marks if mark is handle]
    offloaded = [c.display_path for c in handle.plan.components if c.action != "resident"]
    what = f"{handle.plan.config.mode} mode, offloading {', '.join(offloaded) or 'nothing'}"
    if handle.plan.pipeline_class == plan.pipeline_class:
        where = f"offload is already enabled on this pipeline, by an earlier enable_offload ({what})"
    else:
        by = f"by an enable_offload on {handle.plan.pipeline_class}"
        where = f"offload is already enabled on {', '.join(marked)}, {by} ({what})"
    raise OffloadError(f"{plan.pipeline_class}: {where}; call disable() on its handle before enabling again")


def _raise_after_rollback(plan: ResolvedOffloadPlan, error: BaseException):
    """Raise once the rollback is done: resource errors and our own errors as they are, anything else wrapped
    in `OffloadError` saying that nothing was changed."""
    if isinstance(error, (*RESOURCE_ERRORS, LayerstreamError)) or not isinstance(error, Exception):
        raise error
    raise OffloadError(f"{plan.pipeline_class}: enabling offload failed and was rolled back: {error}") from error


def _commit_handle(plan, device, backend, components, block_modules: Mapping[str, nn.Module] | None = None, *, pipeline=None) -> OffloadHandle:
    """The last step, which cannot fail: mark the components (and guard the streamed ones, their streamed blocks
    and the pipeline against copying, pickling and converting while enabled; wrap the pipeline's LoRA entry
    points) and hand out the handle."""
    streamed = [components[c.path] for c in plan.streamed] if plan.config.mode == "layer" else []
    guarded = [*streamed, *(block_modules or {}).values()]
    unguards = [guard_module_(m) for m in guarded]
    if streamed and pipeline is not None and all(pipeline is not m for m in guarded):
        unguards.append(guard_pipeline_(pipeline, [c.display_path for c in plan.streamed]))
    if streamed and pipeline is not None and hasattr(backend, "wrap_pipeline_"):
        unguards.append(backend.wrap_pipeline_(pipeline))
    if pipeline is not None and all(pipeline is not m for m in components.values()):
        # last: the pipeline's own calls take ownership before anything else runs (the LoRA wrappers included)
        unguards.append(own_pipeline_calls_(pipeline, backend.ownership))

    def forget() -> None:
        for m in components.values():
            m.__dict__.pop(_MARK, None)
        for unguard in unguards:
            unguard()

    handle = OffloadHandle(plan, device, backend, components, on_disable=forget)
    for m in components.values():
        m.__dict__[_MARK] = handle
    return handle
