"""Pass 3 of the resolver: what the config does with each found component (stream, swap, on demand or resident),
with its stream options, and why, in the words `layerstream plan` and the resolved plan's dict show."""

from __future__ import annotations

from typing import Any

from layerstream.config.offload_config import OffloadConfig
from layerstream.plan.checks import check_stream_options
from layerstream.plan.declarations import Declarations
from layerstream.plan.discovery import defines_own_to, resident_parts, tensor_bytes, vision_tower_paths
from layerstream.plan.found import FoundComponent
from layerstream.plan.resolved import ResolvedComponent


def decide_component(
    pipeline_class: str, decl: Declarations, config: OffloadConfig, item: FoundComponent
) -> ResolvedComponent:
    """What `config` does with `item` (`ResolvedComponent.action`), its stream options where it streams (checked),
    and why."""
    action = _action(decl, config, item)
    is_dit = item.category == "dit"
    resident_allowed = is_dit and (decl.resident_allowed(item.path) or item.source == "auto")
    replicated = is_dit or decl.replicated(item.path)
    extra: dict[str, Any] = {}
    if action == "stream":
        options = config.options_for(item.category)
        # the config's resident_layers where it names one, else the count the model declares, else 0
        declared = decl.resident_counts.get(item.path) if is_dit else None
        resident = options.resident_layers if options.resident_layers_given or declared is None else declared
        check_stream_options(pipeline_class, item, options, resident, resident_allowed, replicated)
        extra = {
            "weight_transfer": options.weight_transfer,
            "prefetch_depth": options.prefetch_depth,
            "storage_dtype": options.storage_dtype,
            "resident_layers": resident,
        }
    return ResolvedComponent(
        path=item.path,
        category=item.category,
        module_class=type(item.module).__name__,
        source=item.source,
        stacks=item.stacks,
        action=action,
        total_bytes=tensor_bytes(item.module),
        resident_allowed=resident_allowed,
        replicated=replicated,
        alternates=is_dit and item.path in decl.alternating,
        reason=_reason(action, decl, config, item, extra.get("resident_layers", 0)),
        on_demand=action in ("stream", "on_demand") and item.path in decl.on_demand_paths,
        own_to=defines_own_to(item.module) if action == "resident" else None,
        **extra,
    )


def _action(decl: Declarations, config: OffloadConfig, item: FoundComponent) -> str:
    if decl.declared_resident(item.path):
        return "resident"
    if item.category not in config.components:
        return "resident"  # an unselected on-demand component too: nothing calls its offload_to_cpu()
    if config.mode == "module":
        return "swap"  # on-demand or not: module mode swaps whole components itself
    if item.stacks:
        return "stream"  # an on-demand one as well, after its offload_to_cpu() (see ResolvedComponent.on_demand)
    return "on_demand" if item.path in decl.on_demand_paths else "resident"


def _reason(action: str, decl: Declarations, config: OffloadConfig, item: FoundComponent, resident: int | str) -> str:
    """Why `_action` chose `action` for this component, for `layerstream plan` and the resolved plan's dict."""
    on_demand = item.path in decl.on_demand_paths
    if action == "on_demand":
        return (
            "selected, on demand: the pipeline moves it on and off the device itself (on_demand_component_paths): "
            "offload_to_cpu() at enable, load_to_device() at disable"
        )
    if action == "stream":
        rest = "; " + _stays_on_device(item)
        if on_demand:
            rest = "; on demand: offload_to_cpu() at enable, load_to_device() at disable" + rest
        if resident and item.path in decl.resident_counts and resident == decl.resident_counts[item.path]:
            rest = f"; the model keeps {resident} leading blocks resident (layerwise_resident_layers)" + rest
        where = _SOURCE_WORDS.get(item.source, item.source)
        return f"selected: its {len(item.blocks)} blocks stream (block lists {where}){rest}"
    moved = ""
    if action == "resident" and (own_to := defines_own_to(item.module)) is not None:
        moved = f"; moved through its own {own_to}() to the device at enable, and back through it at disable()"
    if (origin := decl.declared_resident(item.path)) is not None:
        return f"declared resident (the pipeline's {origin}): never streamed or swapped" + moved
    if on_demand and action == "resident":
        return f"on demand, but not selected: it stays resident (offload_to_cpu() is not called); {_plain_reason(action, config, item)}"
    return _plain_reason(action, config, item) + moved


_NAMED_PARTS = 4
"""Parts named in a streamed component's reason (the largest); the rest are counted."""


def _stays_on_device(item: FoundComponent) -> str:
    """What of a streamed component stays on the device, read from the component: its parts outside the streamed
    lists, largest first (a vision tower among them said to be one, with its idle block lists)."""
    streamed = {s.qualified_name[len(item.path) + 1 :] if item.path else s.qualified_name for s in item.stacks}
    parts = resident_parts(item.module, streamed)
    if not parts:
        return "nothing else of it holds tensors"
    towers = vision_tower_paths(item.module)
    named = [_part_words(path, towers, item) for path, _ in parts[:_NAMED_PARTS]]
    if len(parts) > _NAMED_PARTS:
        named.append(f"{len(parts) - _NAMED_PARTS} more")
    return "its other parts stay on the device: " + ", ".join(named)


def _part_words(path: str, towers: tuple[str, ...], item: FoundComponent) -> str:
    if not path:
        return "tensors of its own"
    if path not in towers:
        return path
    idle = [(a, n) for a, n in item.idle_lists if a.startswith(path + ".")]
    if not idle:
        return f"{path} (a vision tower)"
    lists = " and ".join(f"{a} ({n} blocks)" for a, n in idle)
    return f"{path} (a vision tower, with {lists}: the pipeline hands its encoder no image, so it never runs)"


def _plain_reason(action: str, config: OffloadConfig, item: FoundComponent) -> str:
    """Why a component is swapped or stays resident, from its category and the selection alone."""
    if action == "swap":
        return "selected in module mode: moved to the device whole while it runs, back to the host after"
    if item.category in config.components:  # selected, yet resident: there is nothing to stream
        return "selected, but no block list was found in it"
    if item.category == "image_encoder":
        return (
            "image encoders stay resident: they run once per request, ahead of the denoising loop, and are small "
            "beside the DiT (components cannot select them)"
        )
    if item.category == "vae":
        return 'VAEs stay resident in layer mode (in module mode, "vae" in components swaps it)'
    if item.category in ("dit", "text_encoder"):
        return f'not selected ("{item.category}" is not in components)'
    return "not a DiT, text encoder or VAE: stays resident"


_SOURCE_WORDS = {
    "plan": "from the pipeline's _offload_plan",
    "builtin": "from layerstream's built-in plan",
    "class_attribute": "from the class's _layerwise_offload_blocks_attrs",
    "auto": "found automatically",
}
