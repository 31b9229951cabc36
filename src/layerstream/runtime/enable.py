"""`enable_offload`: plan, check, then apply; undo everything if applying fails.

Layer mode packs every streamed block into the host store, moves every other tensor to the device, builds one
slot ring shared by all streamed components and hooks the blocks. Module mode swaps whole components on and
off the device around their forward. Both return an `OffloadHandle`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from layerstream.config.offload_config import OffloadConfig, parse_offload_config
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan, lookup
from layerstream.runtime.copy_engine import make_copy_engine
from layerstream.runtime.errors import OffloadError
from layerstream.runtime.host_store import BlockLayout, HostBlock, align_up, pack_block_, restore_block_
from layerstream.runtime.residency import ResidencyChoice, choose_residency
from layerstream.runtime.safety import check_no_foreign_offload, check_no_shared_block_tensors
from layerstream.runtime.stats import ComponentStats, OffloadStats, OffloadTrace, TraceInterval
from layerstream.runtime.streamer import (
    BlockCounters,
    BlockStreamer,
    StreamedBlock,
    install_block_hooks,
    install_root_hooks,
)

logger = logging.getLogger(__name__)

_MARK = "_layerstream_offload"  # attribute set on each component module while offload is enabled


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
    trace: bool = False,
    process_group=None,
    engine_factory: Callable | None = None,
) -> "OffloadHandle":
    """Enable offload on `pipeline` as `config` selects and return the handle that reports and undoes it.

    `device` defaults to the current CUDA device, else the CPU. `simulated_link_gbps` (CPU only) throttles the
    copy thread to a link of that bandwidth. `trace` records accelerator timing events for `handle.trace()`
    (the CPU engine always records). `engine_factory(device, num_slots)` replaces the copy engine (for
    instrumentation and tests). Enabling is a transaction: on any error the pipeline is left as it was.

    Components with `weight_transfer: "allgather"` shard their blocks' host bytes over `process_group` (default:
    the default group of torch.distributed); every rank of it must call `enable_offload` (and later `disable`)
    with the same model and config. See layerstream.distributed.collectives for the order of collectives and
    what happens when a rank fails.
    """
    config = parse_offload_config(config)
    from layerstream.plan.resolver import resolve_offload_plan  # the resolver is the only reader of plans

    plan = resolve_offload_plan(pipeline, config)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if simulated_link_gbps is not None and device.type != "cpu":
        raise OffloadError(f"simulated_link_gbps = {simulated_link_gbps!r} applies only to the CPU device, not {device}")
    if simulated_link_gbps is not None and (isinstance(simulated_link_gbps, bool) or not simulated_link_gbps > 0):
        raise OffloadError(f"simulated_link_gbps = {simulated_link_gbps!r} is not valid; expected a number > 0")

    components = {c.path: lookup(pipeline, c.path) for c in plan.components}
    for comp in plan.components:
        if getattr(components[comp.path], _MARK, None) is not None:
            raise OffloadError(
                f"{plan.pipeline_class}: offload is already enabled on {comp.display_path}; call disable() on its "
                "handle before enabling again"
            )
    check_no_foreign_offload(plan.pipeline_class, components)
    for comp in plan.components:
        if comp.action in ("stream", "swap", "resident"):
            for name, t in _named_tensors(components[comp.path]):
                if t.device.type == "meta":
                    raise OffloadError(
                        f"{plan.pipeline_class}: {comp.display_path}.{name} is on the meta device (weights not loaded)"
                    )

    if config.mode == "module":
        from layerstream.runtime.module_mode import enable_module_mode

        return enable_module_mode(pipeline, plan, components, device, mark=_MARK)
    if engine_factory is None:
        def engine_factory(device, num_slots):
            return make_copy_engine(device, num_slots, link_gbps=simulated_link_gbps, timing=trace)

    return _enable_layer_mode(pipeline, plan, components, device, engine_factory, process_group)


def _enable_layer_mode(pipeline, plan, components, device, engine_factory, process_group) -> "OffloadHandle":
    # --- plan: which blocks stream, which stay resident -------------------------------------------------
    residency: dict[str, ResidencyChoice] = choose_residency(plan, device)
    streamed_paths: list[tuple[ResolvedComponent, list[list[str]]]] = []
    for comp in plan.streamed:
        kept = set(residency[comp.path].resident_block_paths)
        streamed_paths.append((comp, [[p for p in chain if p not in kept] for chain in _chains_of(comp)]))

    # allgather: the group and its collectives (torch.distributed is imported only when a component asks)
    sharded_paths = {p for comp, chains in streamed_paths if comp.weight_transfer == "allgather" for chain in chains for p in chain}
    gather = None
    if sharded_paths:
        from layerstream.distributed.collectives import open_block_gather
        from layerstream.distributed.sharded_store import stage_sharded_block

        gather = open_block_gather(plan.pipeline_class, device, process_group)  # None: one rank, plain copies
    if gather is None:
        sharded_paths = set()

    try:
        stream_modules: dict[str, nn.Module] = {}
        for comp, chains in streamed_paths:
            for chain in chains:
                for path in chain:
                    stream_modules[path] = lookup(pipeline, path)
        check_no_shared_block_tensors(plan.pipeline_class, components, stream_modules)
        layouts = {path: BlockLayout(path, module, device) for path, module in stream_modules.items()}
    except Exception as e:
        if gather is not None:
            try:
                gather.agree_on_layouts_(failure=e)  # the other ranks learn now instead of at their timeout
            except Exception:  # this rank's own error is the one to report
                logger.exception("telling the other ranks that enable_offload failed did not work")
        raise

    depth = max((comp.prefetch_depth for comp, _ in streamed_paths), default=1)
    num_slots = depth + 1
    slot_nbytes = align_up(
        max(
            (
                gather.world_size * gather.shard_nbytes(layout.nbytes) if path in sharded_paths else layout.nbytes
                for path, layout in layouts.items()
            ),
            default=0,
        )
    )

    # --- check what can be checked before touching anything --------------------------------------------
    if gather is not None:
        # every rank must shard the same layouts before the first payload collective; raises on every rank
        gather.agree_on_layouts_([layout for path, layout in layouts.items() if path in sharded_paths], slot_nbytes)

    # --- apply, with undo --------------------------------------------------------------------------------
    undo: list[Callable[[], None]] = []
    handle = OffloadHandle(plan, device)
    try:
        slot_buffers = [torch.empty(slot_nbytes, dtype=torch.uint8, device=device) for _ in range(num_slots)] if layouts else []
        engine = engine_factory(device, num_slots) if layouts else None
        if engine is not None:
            undo.append(engine.close)

        for comp in plan.components:
            module = components[comp.path]
            if comp.action == "on_demand":
                module.offload_to_cpu()
                continue
            skip = set(stream_modules) if comp.action == "stream" else set()
            _move_tensors_(module, comp.path, skip, device, undo)

        host_blocks: dict[str, HostBlock] = {}
        staged = []
        for path, layout in layouts.items():
            if path in sharded_paths:
                host = stage_sharded_block(layout, gather, device, pin=engine.pin_ if plan.config.pin_memory else None)
                host_blocks[path] = host
                staged.append(host)
                undo.append(host.release_)  # the block still holds its own weights until the commit below
                continue
            original_device = _first_device(layout.block)
            host = pack_block_(layout, device, pin=engine.pin_ if plan.config.pin_memory else None)
            host_blocks[path] = host
            undo.append(lambda host=host, d=original_device: restore_block_(host, d))

        counters = {comp.path: BlockCounters() for comp, _ in streamed_paths}
        blocks: list[StreamedBlock] = []
        chains_idx: list[list[int]] = []
        for comp, chains in streamed_paths:
            for chain in chains:
                if not chain:
                    continue
                chain_idx = []
                for path in chain:
                    blocks.append(
                        StreamedBlock(len(blocks), host_blocks[path], comp.path, stream_modules[path], counters[comp.path], comp.prefetch_depth)
                    )
                    chain_idx.append(blocks[-1].index)
                chains_idx.append(chain_idx)

        streamer = BlockStreamer(blocks, chains_idx, engine, slot_buffers) if blocks else None
        hooks = []
        if streamer is not None:
            for block in blocks:
                hooks += install_block_hooks(streamer, block)
            for comp, _ in streamed_paths:
                hooks += install_root_hooks(streamer, components[comp.path])
        undo.append(lambda: [h.remove() for h in hooks])

        for comp in plan.components:
            setattr(components[comp.path], _MARK, handle)
            undo.append(lambda m=components[comp.path]: _unmark(m))

        if gather is not None:
            gather.commit_()  # every rank staged its shards: only now may any rank drop its original weights
            for host in staged:
                host.drop_original_()
    except BaseException as e:
        if gather is not None and not isinstance(e, KeyboardInterrupt):
            try:
                gather.commit_(failure=e)  # tell the other ranks (if not told yet) so that they roll back too
            except Exception:  # keep rolling back; this rank's own error is the one to report
                logger.exception("telling the other ranks that enable_offload failed did not work")
        for step in reversed(undo):
            try:
                step()
            except Exception:  # keep undoing; the first error is the one to report
                logger.exception("undo step failed while rolling back enable_offload")
        if isinstance(e, (OffloadError, KeyboardInterrupt)):
            raise
        raise OffloadError(f"{plan.pipeline_class}: enabling offload failed and was rolled back: {e}") from e

    handle._attach_layer_mode(
        components=components,
        streamer=streamer,
        engine=engine,
        hooks=hooks,
        host_blocks=host_blocks,
        counters=counters,
        residency=residency,
        slot_bytes=slot_nbytes * num_slots if layouts else 0,
        num_slots=num_slots if layouts else 0,
    )
    logger.info(
        "layerwise offload on %s: %d streamed blocks, %d slots of %.1f MiB",
        plan.pipeline_class,
        len(blocks),
        num_slots,
        slot_nbytes / 2**20,
    )
    return handle


def _chains_of(comp: ResolvedComponent) -> list[list[str]]:
    """Prefetch chains: one through the component's own stacks, one per `offload_submodules` stack."""
    main = [p for s in comp.stacks if not s.own_chain for p in s.block_paths]
    chains = [main] if main else []
    chains += [list(s.block_paths) for s in comp.stacks if s.own_chain]
    return chains


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _first_device(module: nn.Module) -> torch.device:
    for _, t in _named_tensors(module):
        return t.device
    return torch.device("cpu")


def _move_tensors_(root: nn.Module, root_path: str, skip: set[str], device: torch.device, undo: list) -> None:
    """Move every parameter and buffer under `root` to `device`, except inside the modules at `skip` paths."""
    moved: set[int] = set()
    stack = [(root_path, root)]
    while stack:
        path, module = stack.pop()
        if path in skip:
            continue
        for name, param in module._parameters.items():
            if param is None or id(param) in moved or param.device == device:
                continue
            moved.add(id(param))
            old = param.data
            param.data = old.to(device)
            undo.append(lambda p=param, o=old: setattr(p, "data", o))
        for name, buf in module._buffers.items():
            if buf is None or buf.device == device:
                continue
            module._buffers[name] = buf.to(device)
            undo.append(lambda b=module._buffers, n=name, o=buf: b.__setitem__(n, o))
        for child_name, child in module._modules.items():
            if child is not None:
                stack.append((f"{path}.{child_name}" if path else child_name, child))


def _unmark(module: nn.Module) -> None:
    if _MARK in module.__dict__:
        del module.__dict__[_MARK]


class OffloadHandle:
    """What `enable_offload` returns: `stats()`, `trace()` and `disable()`."""

    def __init__(self, plan: ResolvedOffloadPlan, device: torch.device):
        self.plan = plan
        self.device = device
        self.enabled = True
        self._streamer: BlockStreamer | None = None
        self._engine = None
        self._hooks: list = []
        self._host_blocks: dict[str, HostBlock] = {}
        self._counters: dict[str, BlockCounters] = {}
        self._residency: dict[str, ResidencyChoice] = {}
        self._components: dict[str, nn.Module] = {}
        self._slot_bytes = 0
        self._num_slots = 0
        self._module_swapper = None

    def _attach_layer_mode(self, *, components, streamer, engine, hooks, host_blocks, counters, residency, slot_bytes, num_slots):
        self._components = components
        self._streamer = streamer
        self._engine = engine
        self._hooks = hooks
        self._host_blocks = host_blocks
        self._counters = counters
        self._residency = residency
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots

    @property
    def streamer(self) -> BlockStreamer | None:
        return self._streamer

    def stats(self) -> OffloadStats:
        if self._module_swapper is not None:
            return self._module_swapper.stats()
        per: dict[str, ComponentStats] = {}
        for comp in self.plan.components:
            module = self._components.get(comp.path)
            if module is None or comp.action == "on_demand":
                continue
            host = [b.host for b in self._streamer.blocks if b.component == comp.path] if self._streamer else []
            c = self._counters.get(comp.path)
            choice = self._residency.get(comp.path)
            per[comp.path] = ComponentStats(
                bytes_transferred=c.bytes_transferred if c else 0,
                num_transfers=c.num_transfers if c else 0,
                num_sync_loads=c.num_sync_loads if c else 0,
                stall_seconds=c.stall_seconds if c else 0.0,
                device_bytes=_device_bytes(module, self.device),
                host_bytes=sum(h.host_bytes for h in host),
                pinned_host_bytes=sum(h.host_bytes for h in host if h.pinned),
                num_streamed_blocks=len(host),
                num_resident_blocks=len(choice.resident_block_paths) if choice else 0,
            )
        totals = {f: sum(getattr(s, f) for s in per.values()) for f in ComponentStats.__dataclass_fields__}
        totals["device_bytes"] += self._slot_bytes
        return OffloadStats(
            **totals,
            per_component=MappingProxyType(per),
            num_slots=self._num_slots,
            slot_bytes=self._slot_bytes,
            max_materialized_blocks=self._streamer.max_materialized if self._streamer else 0,
            engine=getattr(self._engine, "kind", ""),
            residency=MappingProxyType({p: c.describe() for p, c in self._residency.items()}),
        )

    def block_transfers(self) -> dict[str, int]:
        """Transfers issued per streamed block path (resident blocks never appear)."""
        if self._streamer is None:
            return {}
        return {b.path: b.num_transfers for b in self._streamer.blocks}

    def trace(self) -> OffloadTrace:
        """Every copy and compute interval recorded since enable, on one clock."""
        intervals: list[TraceInterval] = []
        engine = self._engine
        if engine is not None:
            engine.resolve_timings()
            for r in list(engine.copies):
                intervals.append(TraceInterval("copy", r.label, r.start, r.end, r.slot))
        if self._streamer is not None:
            for r in list(self._streamer.compute_records):
                wait, start, end = engine.resolve(r.wait_start), engine.resolve(r.start), engine.resolve(r.end)
                intervals.append(TraceInterval("compute", r.label, start, end, r.slot, stall=start - wait, sync_load=r.sync_load))
        intervals.sort(key=lambda i: (i.start, i.lane))
        return OffloadTrace(tuple(intervals))

    def reset_trace(self) -> None:
        """Forget every recorded interval (copies still waiting for their timing events included)."""
        if self._engine is not None:
            self._engine.copies.clear()
            getattr(self._engine, "_pending_timing", []).clear()
        if self._streamer is not None:
            self._streamer.compute_records.clear()

    def disable(self) -> None:
        """Remove every hook and give back a fully resident pipeline (the same Parameter objects, same values).

        Under allgather this is a collective: every rank must call it (each block's bytes are gathered once)."""
        if not self.enabled:
            return
        if self._module_swapper is not None:
            self._module_swapper.disable()
        else:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._engine is not None:
                self._engine.close()
            # one block at a time, forgetting each once restored: under allgather a restore is a collective
            # that can fail (a peer gone), and calling disable() again must not restore a block twice
            for path in list(self._host_blocks):
                restore_block_(self._host_blocks[path], self.device)
                del self._host_blocks[path]
            if self._streamer is not None:
                self._streamer.slot_buffers.clear()
        for module in self._components.values():
            _unmark(module)
        self.enabled = False

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"OffloadHandle({self.plan.pipeline_class}, mode={self.plan.config.mode}, device={self.device}, {state})"


def _device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of the module's tensors on `device` (evicted blocks hold empty placeholders and count 0)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, t in _named_tensors(module):
        if t.device != device or t.numel() == 0:
            continue
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
