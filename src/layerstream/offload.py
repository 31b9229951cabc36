"""`enable_offload`: plan, check, then apply; undo everything if applying fails.

The composition root, where the layers meet: the config is resolved into a plan (`plan/`), each streamed
component's host store composed from the store kinds (`STORE_KINDS`, `runtime.stores.compose`: sharded allgather
from `distributed/` or local, with `host_budget_gb` the disk tier around them), every block laid out once and
placed (`plan.placement`, in its store's slot and host bytes), and a mode backend of `runtime/` applies it; the
handle it returns reports and undoes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerstream.config.offload_config import AUTO, OffloadConfig, parse_offload_config
from layerstream.errors import LayerstreamError, OffloadError
from layerstream.host.memory import read_host_memory
from layerstream.host.reserve import host_reserve_for
from layerstream.plan.host_budget import HostBudgetChoice, choose_host_budget, host_needs
from layerstream.models.generation_estimates import DEVICE_ALLOWANCE_GB, activation_reserve_nbytes, decode_transient, phase_transients
from layerstream.plan.phase_blocks import phase_blocks
from layerstream.plan.placement import ActivationReserve, Placement, needs_device_budget, place_blocks, read_device_budget
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan, lookup
from layerstream.runtime.engines.copy_engine import make_copy_engine
from layerstream.runtime.modes.handle import OffloadHandle
from layerstream.runtime.modes.hooks import PIPELINE
from layerstream.runtime.modes.layer_mode import EngineFactory, apply_layer_mode
from layerstream.runtime.packing.file_reads import PAGE_BYTES, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.modes.module_mode import apply_module_mode
from layerstream.runtime.streaming.ownership import own_pipeline_calls_
from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS
from layerstream.runtime.stores.compose import LOCAL_KIND, ComponentStores, StoreContext, StoreKind, compose_stores
from layerstream.runtime.contracts import HostStore
from layerstream.runtime.torch_contract.guards import guard_module_, guard_pipeline_
from layerstream.runtime.torch_contract.safety import check_no_foreign_offload, check_no_shared_block_tensors, check_packable_block_tensors
from layerstream.runtime.packing.tensors import named_tensors
from layerstream.runtime.modes.undo import UndoStack
from layerstream.wording import GB

if TYPE_CHECKING:
    from layerstream.models.size import GenerationSize

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
    generation: GenerationSize | None = None,
) -> OffloadHandle:
    """Enable offload on `pipeline` as `config` selects and return the handle that reports and undoes it.

    `device` defaults to the current CUDA device, else the CPU. On the CPU, `simulated_link_gbps` throttles the
    copy thread and `simulated_disk_gbps` every read of the disk tier to that bandwidth. `trace` records
    accelerator timing events for `handle.trace()` (the CPU engine always records).
    `engine_factory(device, num_slots)` and `store_factory(component_path)` replace the copy engine and the host
    stores (to observe or inject).
    `generation`: the largest the pipeline will run, which the host reserve of `host_budget_gb: "auto"` is
    estimated for (None: the model's defaults). Enabling is a transaction: on any error the pipeline is left as
    it was; out-of-memory errors and `KeyboardInterrupt` come out as themselves, other failures as `OffloadError`.

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

    undo, block_modules = UndoStack(), None
    if config.mode == "module":
        apply = functools.partial(apply_module_mode, plan, components, device, undo)
    else:
        # host budget "auto": a number, or no disk tier; the reserve before the stores: a failure has no peers to tell
        plan, host_budget = resolve_host_budget(pipeline, plan, device, process_group, generation)
        from layerstream.models.cache import cache_root  # the cache module reads the environment on every call

        spill_root = Path(config.disk_dir) if config.disk_dir is not None else cache_root() / "spill"
        context = StoreContext(plan, device, components, process_group, spill_root, simulated_disk_gbps)
        reserve = _estimated_reserve(pipeline, plan, device, generation)
        stores = compose_stores(context, STORE_KINDS) if store_factory is None else ComponentStores(
            {comp.path: store_factory(comp.path) for comp in plan.streamed}
        )
        layouts, placement, block_modules = _plan_layer_mode(
            pipeline, plan, components, stores, device, host_budget, reserve
        )
        apply = functools.partial(
            apply_layer_mode, plan=plan, placement=placement, components=components, block_modules=block_modules,
            layouts={p: layouts[p] for p in placement.streamed_block_paths}, stores=stores, device=device,
            engine_factory=engine_factory, undo=undo,
        )  # fmt: skip
    try:
        backend = apply()
    except BaseException as e:
        undo.unwind()
        _raise_after_rollback(plan, e)
    return _commit_handle(plan, device, backend, components, block_modules, pipeline=pipeline)


def _sharded_store(comp: ResolvedComponent, ctx: StoreContext) -> HostStore | None:
    # torch.distributed is imported only when a component asks for it
    from layerstream.distributed.collectives import open_block_gather
    from layerstream.distributed.sharded_store import ShardedHostStore

    gather = open_block_gather(ctx.plan.pipeline_class, ctx.device, ctx.process_group)
    # float8 components' blocks are sharded in their float8 form; a group of one: plain copies (the next kind)
    return ShardedHostStore(gather, ctx.form_of) if gather is not None else None


SHARDED_KIND = StoreKind("sharded-allgather", lambda c: c.weight_transfer == "allgather", _sharded_store, shared=True)
STORE_KINDS: tuple[StoreKind, ...] = (SHARDED_KIND, LOCAL_KIND)
"""The host stores, in order of preference: the first whose kind applies to a component and builds serves it
(allgather before local: the sharded store keeps a component's blocks in their form too; over a group of one it
declines, and the local store serves)."""


def _plan_layer_mode(
    pipeline, plan: ResolvedOffloadPlan, components, stores: ComponentStores, device: torch.device, host_budget=None,
    reserve: ActivationReserve | None = None,
):  # fmt: skip
    """Lay out every block once, place it, tell the stores, and check everything before anything changes:
    (layouts, placement, the streamed block modules). A failure here tells the stores' peers."""
    try:
        layouts = block_layouts(pipeline, plan, device)
        placement = dataclasses.replace(place_for(plan, layouts, stores, device, reserve), host_budget=host_budget)
        stores.place_(placement)
        block_modules = {p: lookup(pipeline, p) for p in placement.streamed_block_paths}
        check_no_shared_block_tensors(plan.pipeline_class, components, block_modules)
    except BaseException as e:
        stores.report_failure_(e)
        raise
    for store, mine in stores.layouts_by_store(placement, layouts):
        store.check_layouts_(mine, placement.slot_nbytes)
    return layouts, placement, block_modules


def block_layouts(
    pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device, *, allow_meta: bool = False
) -> dict[str, BlockLayout]:
    """The packed layout of every streamable block (pure: reads tensors' addresses and shapes, moves nothing).
    `allow_meta` lets planning lay out a skeleton's meta tensors (each its own span, at residue 0). Raises
    `UnsupportedTensorError` for a block holding a tensor that cannot be packed."""
    blocks = {p: lookup(pipeline, p) for comp in plan.streamed for stack in comp.stacks for p in stack.block_paths}
    for path, block in blocks.items():
        check_packable_block_tensors(plan.pipeline_class, path, block)
    return {p: BlockLayout(p, block, device, allow_meta=allow_meta) for p, block in blocks.items()}


def place_for(
    plan: ResolvedOffloadPlan, layouts: Mapping[str, BlockLayout], stores: ComponentStores, device: torch.device,
    reserve: ActivationReserve | None = None,
) -> Placement:  # fmt: skip
    """The placement of `plan` on `device`, pricing each block in its store's slot and host bytes; residency
    "auto" without a budget or reserve given leaves `reserve` free (the generation's estimate)."""
    slot_nbytes, host_nbytes = stores.slot_and_host_nbytes(plan, layouts)
    if not needs_device_budget(plan):
        return place_blocks(plan, slot_nbytes, None, host_nbytes)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None  # None: no free memory to read
    return place_blocks(plan, slot_nbytes, read_device_budget(plan, device, free, reserve), host_nbytes)


def estimated_activation_reserve(
    pipeline: Any, generation: GenerationSize | None, *, tiled: bool = False, device_type: str = "cuda",
) -> ActivationReserve:  # fmt: skip
    """What residency "auto" leaves free on the device (as the planner does): the largest phase's transient for
    `generation` (None: the model's defaults), the VAE decode `tiled` or not, and the allowance."""
    from layerstream.models.generation_size import pipeline_generation

    generation = generation if generation is not None else pipeline_generation(pipeline)
    transients = phase_transients(pipeline, generation, phase_blocks(pipeline))
    decode = decode_transient(pipeline, generation, tiled=tiled, device_type=device_type)
    transients += (decode,) if decode is not None else ()
    largest = max(transients, key=lambda t: t.nbytes)
    why = f"estimated for {generation.describe()}: {largest.phase}, {largest.what}, and an allowance of {DEVICE_ALLOWANCE_GB:g} GB"
    return ActivationReserve(activation_reserve_nbytes(transients, round(DEVICE_ALLOWANCE_GB * GB)), why)


def _estimated_reserve(pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device, generation) -> ActivationReserve | None:
    """`estimated_activation_reserve` where the config gives neither `device_budget_gb` nor `activation_reserve_gb`
    and the device's memory can be read (the decode tiled only where the config says always); else None."""
    options = plan.config.options_for("dit")
    given = options.device_budget_gb is not None or options.activation_reserve_gb is not None
    if not needs_device_budget(plan) or given or device.type != "cuda":
        return None
    try:
        return estimated_activation_reserve(pipeline, generation, tiled=plan.config.vae_use_tiling is True, device_type=device.type)
    except (LayerstreamError, RuntimeError, TypeError, AttributeError, NotImplementedError) as e:  # a model it cannot read
        logger.info("the activation reserve cannot be estimated (%s: %s); the default is kept", type(e).__name__, e)
        return None


def plan_placement(
    pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device | None = None, generation: GenerationSize | None = None,
) -> Placement:  # fmt: skip
    """The placement `enable_offload` would use on `device` for `generation`, for one process (allgather priced
    as local); moves nothing. `OffloadError` where an "auto" setting has no memory to read."""
    device = _check_device(device, None)
    plan, host_budget = resolve_host_budget(pipeline, plan, device, generation=generation)
    placement, _ = priced_placement(pipeline, plan, device, _estimated_reserve(pipeline, plan, device, generation))
    return dataclasses.replace(placement, host_budget=host_budget)


def priced_placement(
    pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device, reserve: ActivationReserve | None = None,
) -> tuple[Placement, dict[str, int]]:  # fmt: skip
    """(the placement of `plan` with local stores and no disk tier, each streamable block's host bytes)."""
    components = {c.path: lookup(pipeline, c.path) for c in plan.streamed}
    local_kinds = tuple(kind for kind in STORE_KINDS if kind is not SHARDED_KIND)  # opens no process group
    stores = compose_stores(StoreContext(plan, device, components), local_kinds, disk_tier=False)
    layouts = block_layouts(pipeline, plan, device, allow_meta=True)  # planning may price a skeleton
    return place_for(plan, layouts, stores, device, reserve), stores.slot_and_host_nbytes(plan, layouts)[1]


def resolve_host_budget(
    pipeline: Any, plan: ResolvedOffloadPlan, device: torch.device, process_group=None,
    generation: GenerationSize | None = None,
) -> tuple[ResolvedOffloadPlan, HostBudgetChoice | None]:  # fmt: skip
    """With `host_budget_gb: "auto"`: the plan with the budget this machine allows (None where every streamed
    block fits: no disk tier) and the choice with its figures; any other plan as it is, with None. Allgather
    ranks budget their share of the host (`_rank_share`). Reads the host memory; moves nothing."""
    from layerstream.models.generation_size import pipeline_generation

    config = plan.config
    if config.host_budget_gb != AUTO:
        return plan, None
    unbudgeted = dataclasses.replace(plan, config=dataclasses.replace(config, host_budget_gb=None, host_reserve_gb=None))
    placement, host_nbytes = priced_placement(pipeline, unbudgeted, device)
    memory = read_host_memory()
    if memory.free_nbytes is None:
        raise OffloadError('host_budget_gb = "auto": this system shows no /proc/meminfo or memory cgroup to read; give host_budget_gb as a number')
    # a stored form's stores (float8, lossless: any storage_dtype) keep a block's own tensors until the commit (an
    # exact rollback), and so do sharded ones (the commit is a vote of every rank): not freed while enabling
    kept_until_commit = {p for c in unbudgeted.streamed if c.storage_dtype is not None for s in c.stacks for p in s.block_paths}
    allgather = {p for c in unbudgeted.streamed if c.weight_transfer == "allgather" for s in c.stacks for p in s.block_paths}
    # blocks that are views of mapped files, whose views packing drops: their clean pages in a cgroup become
    # page cache it can reclaim (a warm cgroup maps more of a cached checkpoint than a cold one)
    if memory.cgroup is not None:  # (MemAvailable counts them already)
        kept = kept_until_commit | allgather
        dropped = [p for p in placement.streamed_block_paths if p not in kept]
        memory = memory.releasing_mapped(mapped_view_nbytes(pipeline, dropped))
    free_nbytes, free_source, host_nbytes, sharded = _rank_share(unbudgeted, process_group, memory, host_nbytes)
    # the generation's own host allocations, for the largest generation it will run (host_reserve_gb overrides it)
    reserve = host_reserve_for(
        pipeline, unbudgeted, config.host_reserve_gb, device_is_host=device.type == "cpu",
        generation=generation if generation is not None else pipeline_generation(pipeline),
    )  # fmt: skip
    needs = host_needs(
        unbudgeted, placement, device_is_host=device.type == "cpu", reserve_nbytes=reserve.nbytes,
        num_staging_buffers=NUM_STAGING_BUFFERS, block_host_nbytes=host_nbytes, reserve_name=reserve.need_name,
    )  # fmt: skip
    streamed = sum(host_nbytes[p] for p in placement.streamed_block_paths)
    freed = [p for p in placement.streamed_block_paths if p not in kept_until_commit | sharded]
    choice = choose_host_budget(
        free_nbytes=free_nbytes,
        free_source=free_source,
        streamed_nbytes=streamed,
        needs=needs,
        held_nbytes=min(held_host_nbytes(pipeline, freed), sum(host_nbytes[p] for p in freed)),
        reserve_reason=reserve.describe() if reserve.parts else "",
    )
    return dataclasses.replace(unbudgeted, config=dataclasses.replace(unbudgeted.config, host_budget_gb=choice.budget_gb)), choice


def _rank_share(plan: ResolvedOffloadPlan, process_group, memory, host_nbytes: Mapping[str, int]):
    """(free host memory, where it came from, each block's host bytes, the sharded block paths): with allgather
    components on several ranks, this rank's share of the host and its shards; else the process's own figures."""
    sharded_components = [c for c in plan.streamed if c.weight_transfer == "allgather"]
    share = None
    if sharded_components:
        from layerstream.distributed.process_group import offload_host_share  # only when a component asks for it

        share = offload_host_share(process_group)
    if share is None:
        return memory.free_nbytes, memory.describe(), host_nbytes, set()
    from layerstream.distributed.collectives import shard_nbytes

    sharded = {p for c in sharded_components for s in c.stacks for p in s.block_paths}
    shares = {p: shard_nbytes(n, share.world_size) if p in sharded else n for p, n in host_nbytes.items()}
    source = (
        f"{memory.describe()}, shared by the {share.ranks_on_host} allgather ranks on this host: 1/{share.ranks_on_host} "
        f"each, spent in this rank's shards (1/{share.world_size} of each sharded block)"
    )
    return memory.free_nbytes // share.ranks_on_host, source, shares, sharded


def _host_tensors(pipeline: Any, block_paths) -> Iterator[torch.Tensor]:
    """The plain host tensors of these blocks (device tensors hold no host memory; subclasses' inner storages
    are not priced here)."""
    for path in block_paths:
        for _, t in named_tensors(lookup(pipeline, path)):
            if t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter):
                yield t


def mapped_view_nbytes(pipeline: Any, block_paths) -> int:
    """Bytes of clean file pages in memory under these blocks' views of mapped files (a page two tensors share
    counted once): packing moves their bytes into the host store or reads them from the file, and drops the
    views."""
    with contextlib.closing(MappedFiles.snapshot()) as files:
        spans = []
        for t in _host_tensors(pipeline, block_paths):
            start, nbytes = t.data_ptr(), t.numel() * t.element_size()  # the tensor's own bytes
            if nbytes and t.is_contiguous() and files.covers(start, nbytes):
                spans.append((start - start % PAGE_BYTES, start + nbytes))
        total, end = 0, 0
        for start, stop in sorted(spans):
            start = max(start, end)  # the part of a page the previous span counted already
            if stop > start:
                total += files.present_file_nbytes(start, stop - start)
                end = -(-stop // PAGE_BYTES) * PAGE_BYTES
        return total


def held_host_nbytes(pipeline: Any, block_paths) -> int:
    """Bytes of these blocks' host storages that are this process's own memory, not views of mapped files
    (packing moves them into the host store or to disk and frees them), each storage counted once."""
    seen: set[int] = set()
    total = 0
    with contextlib.closing(MappedFiles.snapshot()) as files:
        for t in _host_tensors(pipeline, block_paths):
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            if not files.covers(storage.data_ptr(), storage.nbytes()):
                total += storage.nbytes()
    return total


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


def _release_when_dropped(pipeline, backend) -> weakref.finalize | None:
    """Free the engine's thread, the host stores and the spill files when the pipeline (and with it its handle,
    which keeps it) is collected without `disable()`: a server swapping models or a notebook rebuilding a
    pipeline would otherwise leak them each time. Not at interpreter exit (the process frees everything)."""
    release = backend.release_when_dropped()
    if release is None or pipeline is None:
        return None
    finalizer = weakref.finalize(pipeline, release)
    finalizer.atexit = False
    return finalizer


def _raise_after_rollback(plan: ResolvedOffloadPlan, error: BaseException):
    """Raise once the rollback is done: resource errors and our own errors as they are, anything else wrapped
    in `OffloadError` saying that nothing was changed."""
    if isinstance(error, (*RESOURCE_ERRORS, LayerstreamError)) or not isinstance(error, Exception):
        raise error
    raise OffloadError(f"{plan.pipeline_class}: enabling offload failed and was rolled back: {error}") from error


def _commit_handle(plan, device, backend, components, block_modules: Mapping[str, nn.Module] | None = None, *, pipeline=None) -> OffloadHandle:
    """The last step, which cannot fail: mark the components, guard the streamed ones, their blocks and the
    pipeline, wrap the pipeline's LoRA entry points and calls (all recorded on `backend.hooks`); the handle."""
    hooks = backend.hooks
    streamed = {c.display_path: components[c.path] for c in plan.streamed} if plan.config.mode == "layer" else {}
    guarded = {**streamed, **(block_modules or {})}
    guard = "refuses copying, pickling and converting while enabled"
    for path, module in guarded.items():
        hooks.add(path, "guard", guard, guard_module_(module))
    is_component = pipeline is None or any(pipeline is m for m in (*components.values(), *guarded.values()))
    if streamed and not is_component:
        hooks.add(PIPELINE, "guard", guard + " (and its other ways of moving components)", guard_pipeline_(pipeline, list(streamed)))
        backend.wrap_pipeline_(pipeline)
    if not is_component:
        # last: the pipeline's own calls take ownership before anything else runs (the LoRA wrappers included)
        hooks.add(PIPELINE, "ownership", "one thread at a time from the entry of __call__ and encode_prompt", own_pipeline_calls_(pipeline, backend.ownership))

    finalizer = _release_when_dropped(pipeline, backend)

    def forget() -> None:
        if finalizer is not None:
            finalizer.detach()  # disabled: nothing is left to release
        for m in components.values():
            m.__dict__.pop(_MARK, None)

    handle = OffloadHandle(plan, device, backend, components, on_disable=forget, pipeline=pipeline)
    for m in components.values():
        m.__dict__[_MARK] = handle
    return handle
