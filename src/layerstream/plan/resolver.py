"""`resolve_offload_plan`: the one reader of offload plans; pure, so every backend can trust its answer.

Resolution runs in three passes over plain data:
1. discover: enumerate components (skipping declared ones the instance does not hold, and leaving untouched the
   children a pipeline that declares its roles does not name), categorize them and find their block lists,
   recording where each list came from (pipeline plan, built-in plan, class attribute, automatic; automatic
   discovery keeps out a vision tower the pipeline never runs); the declarations themselves are read by
   `plan.declarations`;
2. check what does not depend on the config: declared paths, types, a block claimed twice;
3. decide what the config does with each component, and reject selections that cannot work.
Modules are only read: no tensor moves, no hook is installed, no attribute changes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from layerstream.config.offload_config import LayerOptions, OffloadConfig, parse_offload_config
from layerstream.plan.declarations import Declarations
from layerstream.plan.discovery import (
    ROLE_LISTS,
    block_list_at,
    categorize,
    class_block_attrs,
    declared_absent,
    defines_own_to,
    enumerate_components,
    find_block_lists,
    hands_encoder_images,
    resident_parts,
    resolution_error,
    tensor_bytes,
    vision_tower_paths,
)
from layerstream.plan.resolved import (
    AbsentComponent,
    BlockStack,
    ResolvedComponent,
    ResolvedOffloadPlan,
    UntouchedComponent,
    join_path,
    lookup,
)

logger = logging.getLogger(__name__)

STREAMABLE_CATEGORIES = ("dit", "text_encoder")
"""Categories whose block lists are discovered (and may stream in layer mode)."""
ON_DEMAND_METHODS = ("load_to_device", "offload_to_cpu")


@dataclass
class _Found:
    """A component after discovery, before the config is applied."""

    path: str
    module: nn.Module
    category: str
    source: str
    stacks: tuple[BlockStack, ...]
    blocks: dict[str, nn.Module]
    """Block path -> block module, for every stack."""
    idle_lists: tuple[tuple[str, int], ...] = ()
    """(attribute path, number of blocks) of the block lists automatic discovery found in a vision tower the
    pipeline never runs (`hands_encoder_images`): kept out of `stacks`, so they stay on the device."""

    @property
    def main_blocks(self) -> int:
        """Blocks on the component's own prefetch chain (``resident_layers`` counts along it)."""
        return sum(s.num_blocks for s in self.stacks if not s.own_chain)


def resolve_offload_plan(pipeline: Any, config: OffloadConfig | Mapping | str) -> ResolvedOffloadPlan:
    """Decide, without touching the pipeline, what offload does with each of its components under `config`.

    `pipeline` is a diffusers pipeline, an nn.Module pipeline (vllm-omni style, with ``_offload_plan`` and
    ``_dit_modules``/``_encoder_modules``/``_vae_modules``) or a bare model. `config` is an `OffloadConfig` or
    anything `parse_offload_config` accepts. Raises `OffloadConfigError` for a bad config and
    `OffloadPlanResolutionError` (naming the pipeline class and the path) when the pipeline and config do not fit.
    """
    config = parse_offload_config(config)
    pipeline_class = type(pipeline).__name__
    decl = Declarations(pipeline, pipeline_class)
    decl.check()

    found, absent, untouched = _discover(pipeline, decl)
    _check_block_claims(pipeline_class, found, untouched)
    _check_on_demand_methods(pipeline_class, decl, found)
    components = tuple(_decide(pipeline_class, decl, config, item) for item in found)
    absent += _check_resident_paths(pipeline, decl, components, untouched)
    _check_selection(pipeline_class, config, found, components, absent)
    return ResolvedOffloadPlan(
        pipeline_class=pipeline_class,
        config=config,
        components=components,
        absent=absent,
        untouched=tuple(UntouchedComponent(p, type(m).__name__, tensor_bytes(m)) for p, m in untouched.items()),
    )


# --- pass 1: discovery -------------------------------------------------------------------------------------


def _discover(
    pipeline: Any, decl: Declarations
) -> tuple[list[_Found], tuple[AbsentComponent, ...], dict[str, nn.Module]]:
    """(every component found, the declared ones this instance does not hold, the children left untouched)."""
    cls = decl.pipeline_class
    declared = decl.component_paths()
    modules = enumerate_components(pipeline, declared, cls)
    absent = tuple(_absent(cls, path, declared[path], why) for path, why in declared_absent(pipeline, declared).items())
    untouched = _untouched(decl, modules)
    modules = {p: m for p, m in modules.items() if p not in untouched}
    hands_images = hands_encoder_images(pipeline)
    submodules = _submodule_owners(pipeline, decl, modules, {a.path for a in absent})
    found: list[_Found] = []
    for path, module in modules.items():
        category = "dit" if path == "" else _category(decl, path)  # "": a bare model, handed in as the DiT
        own_submodules = {p: m for p, (owner, m, _) in submodules.items() if owner == path}
        if own_submodules and category != "dit":
            raise resolution_error(
                cls,
                next(iter(own_submodules)),
                f"declared in _offload_plan.offload_submodules but its component {path!r} is {category!r}, not a DiT",
            )
        lists, source, idle = _find_block_lists(decl, path, module, category, own_submodules.values(), hands_images)
        for sub_path, sub in own_submodules.items():
            attr = submodules[sub_path][2]
            origin = f"_offload_plan.offload_submodules[{sub_path!r}]"
            lists.append((sub_path, attr, block_list_at(cls, sub, sub_path, attr, origin), True))
        if own_submodules and source == "none":
            source = "plan"  # the DiT's only block lists are the ones its plan names in offload_submodules
        stacks = tuple(_stack(owner, attr, blocks, own_chain) for owner, attr, blocks, own_chain in lists)
        block_modules = {
            join_path(join_path(owner, attr), name): block
            for owner, attr, blocks, _ in lists
            for name, block in blocks.named_children()
        }
        logger.debug("%s: %s is %s, %d block lists from %s", cls, path or "<model>", category, len(stacks), source)
        found.append(_Found(path, module, category, source, stacks, block_modules, idle))
    return found, absent, untouched


def _untouched(decl: Declarations, modules: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The children a pipeline that declares its roles names nowhere: vllm-omni leaves them where they are (a
    module the pipeline keeps off the device on purpose stays off it). {} for any other pipeline."""
    if not decl.declares_roles:
        return {}
    own = decl.own_component_paths()
    untouched = {p: m for p, m in modules.items() if p not in own}
    for path in untouched:
        logger.debug("%s: %s is in none of %s: untouched", decl.pipeline_class, path, ", ".join(ROLE_LISTS))
    return untouched


def _absent(pipeline_class: str, path: str, declared_in: str, why: str) -> AbsentComponent:
    # vllm-omni skips these too: diffusers pipelines hold None for optional components that are not loaded
    logger.debug("%s: %s, declared in %s, is absent (%s): skipped", pipeline_class, path, declared_in, why)
    return AbsentComponent(path, declared_in, why)


def _category(decl: Declarations, path: str) -> str:
    category = categorize(
        path,
        dit_paths=decl.dit_paths,
        encoder_types=decl.encoder_types,
        encoder_modules=decl.encoder_modules,
        vae_modules=decl.vae_modules,
        listed_roles=decl.listed_roles,
    )
    if path in decl.plan.resident_dit_paths and category != "dit":
        raise resolution_error(
            decl.pipeline_class,
            path,
            f"listed in _offload_plan.resident_dit_paths but it is {category!r}; only DiTs (block_attrs keys, "
            "_dit_modules, or a name starting with 'transformer') may keep resident layers",
        )
    if path in decl.resident_counts and category != "dit":
        raise resolution_error(
            decl.pipeline_class,
            path,
            f"listed in layerwise_resident_layers but it is {category!r}; only DiTs keep resident layers",
        )
    return category


def _submodule_owners(
    pipeline: Any, decl: Declarations, modules: Mapping[str, nn.Module], absent: set[str]
) -> dict[str, tuple[str, nn.Module, str]]:
    """Full pipeline path of each `offload_submodules` entry -> (the component it lies in, the submodule, its
    block-list attribute). An entry is a pipeline path (``"transformer.token_refiner"``) or, as vllm-omni keys
    them, the name of a child of a DiT (``"token_refiner"``: of every DiT that has one)."""
    origin = "_offload_plan.offload_submodules"
    out: dict[str, tuple[str, nn.Module, str]] = {}
    dits = [c for c in modules if c and _category(decl, c) == "dit"]
    for key, attr in decl.offload_submodules.items():
        owners = [c for c in modules if c and key.startswith(c + ".")]
        if owners:
            paths = {key: max(owners, key=len)}
        else:
            paths = {f"{dit}.{key}": dit for dit in dits if _has_path(modules[dit], key)}
        if not paths and any(key.startswith(p + ".") for p in absent):
            logger.debug("%s: %s[%r] lies in an absent component: skipped", decl.pipeline_class, origin, key)
            continue
        if not paths:
            raise resolution_error(
                decl.pipeline_class,
                key,
                f"declared in {origin} but it is neither inside a component nor a child of a DiT (components: "
                f"{', '.join(modules) or 'none'}); name a DiT's child ('context_encoder') or its pipeline path "
                "('transformer.context_encoder')",
            )
        for path, owner in paths.items():
            out[path] = (owner, _submodule_at(pipeline, decl, path, origin), attr)
    return out


def _has_path(module: nn.Module, dotted: str) -> bool:
    try:
        lookup(module, dotted)
    except AttributeError:
        return False
    return True


def _submodule_at(pipeline: Any, decl: Declarations, path: str, origin: str) -> nn.Module:
    try:
        module = lookup(pipeline, path)
    except AttributeError as e:
        problem = f"declared in {origin} but there is no such attribute ({e})"
        raise resolution_error(decl.pipeline_class, path, problem) from e
    if not isinstance(module, nn.Module):
        problem = f"declared in {origin} but it is {type(module).__name__}; expected an nn.Module"
        raise resolution_error(decl.pipeline_class, path, problem)
    return module


_BlockList = tuple[str, str, nn.Module, bool]  # (owner path, attribute path, the list, own_chain)


def _find_block_lists(
    decl: Declarations, path: str, module: nn.Module, category: str, skip: Iterable[nn.Module], hands_images: bool
) -> tuple[list[_BlockList], str, tuple[tuple[str, int], ...]]:
    """The component's block lists, their source (in precedence order: plan, builtin, class, auto) and the lists
    automatic discovery keeps out because they never run.

    A plan may describe the block lists of any component; they are checked and reported, but only the
    streamable categories look further (class attribute, automatic) and only they stream. Automatic discovery
    finds every list of the model's block classes, a vision-language encoder's vision blocks included (its
    ``_no_split_modules`` names them); where the pipeline hands its encoders no image (`hands_encoder_images`),
    the tower never runs, and streaming it would only spend a prefetch and a synchronous load on it each call:
    those lists stay on the device with the rest of the tower. Declared lists are taken as declared.
    """
    cls = decl.pipeline_class
    declared = decl.block_attrs(path, category)
    idle: tuple[tuple[str, int], ...] = ()
    if declared is not None:
        attrs, source, origin = declared
    elif category not in STREAMABLE_CATEGORIES:
        return [], "none", idle
    elif (class_attrs := class_block_attrs(module, cls, path)) is not None:
        attrs, source = class_attrs, "class_attribute"
        origin = f"{type(module).__name__}._layerwise_offload_blocks_attrs"
    else:
        attrs, source, origin = find_block_lists(module, skip=tuple(skip)), "auto", "automatic discovery"
        if not hands_images:
            towers = vision_tower_paths(module)
            idle = tuple((a, len(lookup(module, a))) for a in attrs if any(a.startswith(t + ".") for t in towers))
            attrs = tuple(a for a in attrs if a not in dict(idle))
        if not attrs:
            return [], "none", idle
    return [(path, attr, block_list_at(cls, module, path, attr, origin), False) for attr in attrs], source, idle


def _stack(owner_path: str, attr_path: str, blocks: nn.Module, own_chain: bool) -> BlockStack:
    prefix = join_path(owner_path, attr_path)
    children = list(blocks.named_children())
    return BlockStack(
        owner_path=owner_path,
        attr_path=attr_path,
        block_paths=tuple(join_path(prefix, name) for name, _ in children),
        block_bytes=tuple(tensor_bytes(block) for _, block in children),
        own_chain=own_chain,
    )


# --- pass 2: config-independent checks ---------------------------------------------------------------------


def _check_block_claims(pipeline_class: str, found: list[_Found], untouched: Mapping[str, nn.Module]) -> None:
    """Every module inside a block belongs to that block only: not to a second stack, and not to another
    component or an untouched child (an alias such as ``transformer_2 = transformer``). Streaming one would
    corrupt the other."""
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


def _check_on_demand_methods(pipeline_class: str, decl: Declarations, found: list[_Found]) -> None:
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


# --- pass 3: apply the config ------------------------------------------------------------------------------


def _decide(pipeline_class: str, decl: Declarations, config: OffloadConfig, item: _Found) -> ResolvedComponent:
    action = _action(decl, config, item)
    is_dit = item.category == "dit"
    resident_allowed = is_dit and (decl.resident_allowed(item.path) or item.source == "auto")
    replicated = is_dit or decl.replicated(item.path)
    extra: dict[str, Any] = {}
    if action == "stream":
        options = config.options_for(item.category)
        resident = _resident_layers(decl, options, item)
        _check_stream_options(pipeline_class, item, options, resident, resident_allowed, replicated)
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


def _action(decl: Declarations, config: OffloadConfig, item: _Found) -> str:
    if decl.declared_resident(item.path):
        return "resident"
    if item.category not in config.components:
        return "resident"  # an unselected on-demand component too: nothing calls its offload_to_cpu()
    if config.mode == "module":
        return "swap"  # on-demand or not: module mode swaps whole components itself
    if item.stacks:
        return "stream"  # an on-demand one as well, after its offload_to_cpu() (see ResolvedComponent.on_demand)
    return "on_demand" if item.path in decl.on_demand_paths else "resident"


def _resident_layers(decl: Declarations, options: LayerOptions, item: _Found) -> int | str:
    """The config's resident_layers where it names one, else the count the model declares, else 0."""
    declared = decl.resident_counts.get(item.path) if item.category == "dit" else None
    return options.resident_layers if options.resident_layers_given or declared is None else declared


def _reason(action: str, decl: Declarations, config: OffloadConfig, item: _Found, resident: int | str) -> str:
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


def _stays_on_device(item: _Found) -> str:
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


def _part_words(path: str, towers: tuple[str, ...], item: _Found) -> str:
    if not path:
        return "tensors of its own"
    if path not in towers:
        return path
    idle = [(a, n) for a, n in item.idle_lists if a.startswith(path + ".")]
    if not idle:
        return f"{path} (a vision tower)"
    lists = " and ".join(f"{a} ({n} blocks)" for a, n in idle)
    return f"{path} (a vision tower, with {lists}: the pipeline hands its encoder no image, so it never runs)"


def _plain_reason(action: str, config: OffloadConfig, item: _Found) -> str:
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


def _check_stream_options(
    pipeline_class: str, item: _Found, options: LayerOptions, resident: int | str, resident_allowed: bool, replicated: bool
) -> None:
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


def _check_selection(
    pipeline_class: str,
    config: OffloadConfig,
    found: list[_Found],
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


def _check_resident_paths(
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
    return tuple(_absent(cls, path, declared[path], why) for path, why in absent.items())


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
