"""Pass 1 of the resolver: every component of a pipeline found, categorized, with its block lists and where they
came from, applying `plan.discovery`'s rules in precedence order (pipeline plan, built-in plan, class attribute,
automatic). Declared components the instance does not hold are reported absent; a pipeline that declares its
roles leaves the children it does not name untouched. Modules are only read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from layerstream.plan.declarations import Declarations
from layerstream.plan.discovery import (
    ROLE_LISTS,
    block_list_at,
    categorize,
    class_block_attrs,
    declared_absent,
    enumerate_components,
    find_block_lists,
    hands_encoder_images,
    resolution_error,
    tensor_bytes,
    vision_tower_paths,
)
from layerstream.plan.resolved import AbsentComponent, BlockStack, join_path, lookup

logger = logging.getLogger(__name__)

STREAMABLE_CATEGORIES = ("dit", "text_encoder")
"""Categories whose block lists are discovered (and may stream in layer mode)."""


@dataclass
class FoundComponent:
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


def find_components(
    pipeline: Any, decl: Declarations
) -> tuple[list[FoundComponent], tuple[AbsentComponent, ...], dict[str, nn.Module]]:
    """(every component found, the declared ones this instance does not hold, the children left untouched)."""
    cls = decl.pipeline_class
    declared = decl.component_paths()
    modules = enumerate_components(pipeline, declared, cls)
    absent = tuple(absent_component(cls, p, declared[p], why) for p, why in declared_absent(pipeline, declared).items())
    untouched = _untouched(decl, modules)
    modules = {p: m for p, m in modules.items() if p not in untouched}
    hands_images = hands_encoder_images(pipeline)
    submodules = _submodule_owners(pipeline, decl, modules, {a.path for a in absent})
    found: list[FoundComponent] = []
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
        found.append(FoundComponent(path, module, category, source, stacks, block_modules, idle))
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


def absent_component(pipeline_class: str, path: str, declared_in: str, why: str) -> AbsentComponent:
    """A declared path this instance does not hold (a component, or a resident path), skipped with a debug line."""
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
