"""The resolver's checks, each raising `OffloadPlanResolutionError` naming the pipeline class, the path and a way
out: what does not depend on the config (a module claimed twice, an on-demand component without its two calls) and
what the config asks (allgather on tensors that differ by rank, resident layers a DiT does not allow, resident paths
that would move, a selection that selects nothing or leaves nothing to prefetch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from layerstream.config.offload_config import LayerOptions, OffloadConfig
from layerstream.plan.declarations import Declarations
from layerstream.plan.discovery import ROLE_LISTS, declared_absent, resolution_error
from layerstream.plan.found import STREAMABLE_CATEGORIES, FoundComponent, absent_component
from layerstream.plan.resolved import AbsentComponent, ResolvedComponent, join_path

ON_DEMAND_METHODS = ("load_to_device", "offload_to_cpu")


def check_block_claims(pipeline_class: str, found: list[FoundComponent], untouched: Mapping[str, nn.Module]) -> None:
    """Every module inside a block belongs to that block only: not to a second stack, and not to another component or an
    untouched child (an alias such as ``transformer_2 = transformer``). Streaming one would corrupt the other."""
    claims: dict[int, tuple[str, str]] = {}  # id(module) -> (block path, component path)
    for item in found:
        for block_path, block in item.blocks.items():
            for name, sub in block.named_modules(remove_duplicate=False):
                owner = claims.setdefault(id(sub), (block_path, item.path))
                if owner[0] != block_path:
                    raise resolution_error(
                        pipeline_class,
                        join_path(block_path, name),
                        f"this module is also part of block {owner[0]!r}; a module may belong to one streamed "
                        "block only (check for overlapping block lists or shared modules)",
                    )
    holders = [(item.path, item.module) for item in found] + list(untouched.items())
    for path, module in holders:
        for name, sub in module.named_modules(remove_duplicate=False):
            owner = claims.get(id(sub))
            if owner is not None and owner[1] != path:
                raise resolution_error(
                    pipeline_class,
                    join_path(path, name),
                    f"this module is block {owner[0]!r} of component {owner[1] or '<model>'!r}; a block may "
                    "belong to one component only",
                )


def check_on_demand_methods(pipeline_class: str, decl: Declarations, found: list[FoundComponent]) -> None:
    """An on-demand component implements the two calls the pipeline's residency goes through (checked whether or
    not this config will make them: the declaration is wrong either way)."""
    for item in found:
        if item.path not in decl.on_demand_paths:
            continue
        missing = [m for m in ON_DEMAND_METHODS if not callable(getattr(item.module, m, None))]
        if missing:
            raise resolution_error(
                pipeline_class,
                item.path,
                f"listed in on_demand_component_paths but {type(item.module).__name__} has no callable "
                f"{' or '.join(f'{m}()' for m in missing)}; an on-demand component must implement "
                f"{' and '.join(f'{m}()' for m in ON_DEMAND_METHODS)}",
            )


def check_stream_options(
    pipeline_class: str,
    item: FoundComponent,
    options: LayerOptions,
    resident: int | str,
    resident_allowed: bool,
    replicated: bool,
) -> None:
    """A streamed component's options: allgather only where its block tensors are the same on every rank, resident
    layers only where the DiT allows them."""
    key = f"layer_options.{item.category}"
    if options.weight_transfer == "allgather" and not replicated:
        raise resolution_error(
            pipeline_class,
            item.path,
            f'{key}.weight_transfer = "allgather" needs block tensors identical on every rank, but this '
            f"{item.category} is not in the plan's encoder_dlo_weight_replication; use \"rank-local\" or "
            "declare it there",
        )
    if isinstance(resident, int) and resident > 0:
        if not resident_allowed:
            raise resolution_error(
                pipeline_class,
                item.path,
                f"{key}.resident_layers = {resident} but this DiT does not allow resident layers; declare it in the "
                "plan's resident_dit_paths, or set resident_layers to 0",
            )
        # more than the DiT has keeps every block resident, as vllm-omni does (the placement says so)


def check_selection(
    pipeline_class: str,
    config: OffloadConfig,
    found: list[FoundComponent],
    components: tuple[ResolvedComponent, ...],
    absent: tuple[AbsentComponent, ...] = (),
) -> None:
    """Reject a selection that selects nothing, or leaves nothing to prefetch. In layer mode a selected on-demand
    component without blocks counts: the pipeline manages it."""
    acting = "swap" if config.mode == "module" else "stream"
    for category in config.components:
        members = [c for c in components if c.category == category]
        if any(c.action == acting or (acting == "stream" and c.action == "on_demand") for c in members):
            continue
        hint = (_HINTS.get(category) if acting == "stream" else None) or (
            f"name or declare a component as {category} (_dit_modules, _vae_modules, encoder_component_types), "
            f"or remove {category!r} from components"
        )
        untyped = [f.path for f in found if f.stacks and f.category not in STREAMABLE_CATEGORIES]
        if category == "text_encoder" and untyped:
            hint += f"; block lists were found in {', '.join(untyped)}, which encoder_component_types does not type"
        if absent:
            hint += "; declared but absent: " + ", ".join(f"{a.path} ({a.declared_in}: {a.why})" for a in absent)
        if not members:
            listing = ", ".join(f"{c.display_path} ({c.category})" for c in components) or "none"
            raise resolution_error(
                pipeline_class,
                "components",
                f'components selects "{category}" but the pipeline has no {category} component '
                f"(components: {listing}); {hint}",
            )
        listing = ", ".join(f"{c.display_path} ({_why_not(c, acting)})" for c in members)
        raise resolution_error(
            pipeline_class,
            ", ".join(c.display_path for c in members),
            f'components selects "{category}" but no {category} component can {acting} ({listing}); {hint}',
        )
    if config.mode == "layer":
        _check_something_to_prefetch(pipeline_class, components)


_HINTS = {
    "dit": "declare block_attrs in the pipeline's _offload_plan, or _layerwise_offload_blocks_attrs on the DiT class",
    "text_encoder": "declare encoder_component_types and encoder_block_attrs in the pipeline's _offload_plan",
}


def _why_not(comp: ResolvedComponent, acting: str) -> str:
    if acting == "stream" and not comp.stacks:
        return "no block list found"
    return f"{comp.action}: {comp.reason}" if comp.reason.startswith("declared resident") else comp.action


def check_resident_paths(
    pipeline: Any, decl: Declarations, components: tuple[ResolvedComponent, ...], untouched: Mapping[str, nn.Module]
) -> tuple[AbsentComponent, ...]:
    """Every ``resident_paths`` and ``_resident_modules`` entry stays on the device: a component (resident by
    `_action`) or a module inside one that does not move it; refused where it would move (inside a streamed block,
    a swapped or an on-demand component) or where nothing moves it (inside a child left untouched). Entries this
    instance does not hold are skipped, and returned."""
    cls = decl.pipeline_class
    declared = decl.resident_paths()
    absent = declared_absent(pipeline, declared)
    for path, origin in declared.items():
        if path in absent:
            continue
        holder = next((u for u in untouched if path.startswith(u + ".")), None)
        if holder is not None:
            raise resolution_error(
                cls,
                path,
                f"listed in {origin} but it lies in {holder!r}, which none of {', '.join(ROLE_LISTS)} names, so "
                f"enabling leaves it untouched; name {holder!r} in one of them, or list {holder!r} itself in {origin}",
            )
        for comp in components:
            if comp.path and not path.startswith(comp.path + "."):
                continue  # not inside this component (the component itself, or one inside the path, is resident)
            blocks = [p for s in comp.stacks for p in s.block_paths] if comp.action == "stream" else []
            moved = [p for p in blocks if path == p or path.startswith(p + ".") or p.startswith(path + ".")]
            if comp.action in ("swap", "on_demand") or comp.on_demand or moved:
                what = f"block {moved[0]!r} streams" if moved else f"its component {comp.display_path!r} moves whole"
                raise resolution_error(
                    cls,
                    path,
                    f"listed in {origin} but {what} ({comp.action}); keep the whole component resident (list "
                    f"{comp.display_path!r}) or leave it out of the selection",
                )
    return tuple(absent_component(cls, path, declared[path], why) for path, why in absent.items())


def _check_something_to_prefetch(pipeline_class: str, components: tuple[ResolvedComponent, ...]) -> None:
    # counted before residency: resident_layers may leave a single block streaming (it then stays in its slot)
    streamable = [p for comp in components if comp.action == "stream" for s in comp.stacks for p in s.block_paths]
    if len(streamable) == 1:
        raise resolution_error(
            pipeline_class,
            streamable[0],
            "this would be the only streamed block, so there is nothing to prefetch behind it; select more "
            "components or declare more blocks",
        )
