"""Discovery: which components a pipeline holds, what they are, and where their block lists live.

Everything here only reads modules (attribute lookups, `named_children`, tensor sizes); nothing moves a
tensor, installs a hook or sets an attribute. The resolver combines these pieces in precedence order.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Mapping
from itertools import chain
from typing import Any

from torch import nn

from layerstream.plan.resolved import OffloadPlanResolutionError, join_path, lookup

BLOCK_LIST_TYPES = (nn.ModuleList, nn.Sequential)
ROLE_LISTS = ("_dit_modules", "_encoder_modules", "_vae_modules")
"""Pipeline class attributes (vllm-omni style) that name component paths by role. A pipeline that sets all three
(vllm-omni's `SupportsComponentDiscovery`, each list possibly empty) declares its roles: its lists, with
``_resident_modules`` and its own ``_offload_plan``, are then the whole picture."""
RESIDENT_LIST = "_resident_modules"
"""Pipeline class attribute (vllm-omni style, optional) naming modules kept on the device while offloading."""
PIPELINE_MODULE_LISTS = (*ROLE_LISTS, RESIDENT_LIST)
"""Every pipeline class attribute that names component paths."""
FORWARDING_TO_CLASSES = frozenset(
    {"diffusers.models.modeling_utils.ModelMixin", "transformers.modeling_utils.PreTrainedModel"}
)
"""Library base classes whose ``to()`` only checks its arguments (quantized weights) and calls torch's: a component
that inherits its ``to()`` from one of them does not move itself (by qualified name: no library is imported)."""
IMAGE_ARGUMENTS = ("image", "images", "pixel_values")
"""Argument names through which a pipeline's prompt encoding takes an image (diffusers' ``encode_prompt(prompt,
image, ...)`` in Qwen-Image-Edit and HunyuanVideo image-to-video; transformers' ``pixel_values`` for a
vision-language model handed in by itself)."""
CLASS_BLOCK_ATTRS = "_layerwise_offload_blocks_attrs"
"""Model class attribute naming its block lists, e.g. ``["blocks"]``."""
CLASS_BLOCK_ATTR_SINGULAR = "_layerwise_offload_blocks_attr"
"""The older, deprecated spelling vllm-omni still honours: one attribute name as a string (``"blocks"``)."""


def _declared_block_attrs(module: nn.Module):
    """The class's block-list declaration: the plural list, else the singular string as a one-item list."""
    value = getattr(type(module), CLASS_BLOCK_ATTRS, None)
    if value is None:
        singular = getattr(type(module), CLASS_BLOCK_ATTR_SINGULAR, None)
        if isinstance(singular, str) and singular:
            return [singular]
    return value


def resolution_error(pipeline_class: str, path: str, problem: str) -> OffloadPlanResolutionError:
    """The resolver's error: ``"<PipelineClass>: <path>: <problem>"`` (``<model>`` for the empty path)."""
    return OffloadPlanResolutionError(f"{pipeline_class}: {path or '<model>'}: {problem}")


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the module's distinct parameters and buffers (numel * element_size, so meta tensors count)."""
    seen: set[int] = set()
    total = 0
    for tensor in chain(module.parameters(), module.buffers()):
        if id(tensor) not in seen:  # tied weights are stored once
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def declared_paths(pipeline: Any, attr: str, pipeline_class: str) -> tuple[str, ...]:
    """The component paths a pipeline lists in `attr` (``_dit_modules`` ...), or () when it lists none."""
    value = getattr(pipeline, attr, None)
    if value is None:
        return ()
    kinds = (list, tuple, set, frozenset)
    return _attribute_paths(pipeline_class, attr, attr, value, kinds, "a list of attribute paths")


def _attribute_paths(
    pipeline_class: str, path: str, name: str, value: Any, kinds: tuple[type, ...], expected: str
) -> tuple[str, ...]:
    """`value` (the declaration `name`) as a tuple of non-empty attribute paths; a bare string is a common slip."""
    if isinstance(value, str) or not isinstance(value, kinds):
        raise resolution_error(pipeline_class, path, f"{name} = {value!r} is not valid; expected {expected}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise resolution_error(pipeline_class, path, f"{name} holds {item!r}; expected non-empty attribute paths")
    return tuple(value)


def declares_components(pipeline: Any) -> bool:
    """True when the object declares its parts: an ``_offload_plan`` or one of `PIPELINE_MODULE_LISTS`."""
    return any(getattr(pipeline, attr, None) is not None for attr in ("_offload_plan", *PIPELINE_MODULE_LISTS))


def enumerate_components(
    pipeline: Any, declared: Mapping[str, str], pipeline_class: str
) -> dict[str, nn.Module]:
    """Component path -> module, in the pipeline's order.

    The base set is a diffusers pipeline's ``components`` (its nn.Module values), an nn.Module pipeline's
    named children, or the object itself (path ``""``) when it is a bare model: an nn.Module that declares
    nothing and holds a discoverable block list of its own. `declared` (path -> who declared it, for error
    messages) adds dotted paths; a declared path replaces the base component it lies inside. Declared paths
    the instance does not hold (`declared_absent`) are skipped.
    """
    registry = getattr(pipeline, "components", None)
    if isinstance(registry, Mapping):
        base = list(registry.items())
    elif isinstance(pipeline, nn.Module):
        if not declares_components(pipeline) and has_own_block_lists(pipeline):
            return {"": pipeline}
        base = list(pipeline.named_children())
    else:
        raise resolution_error(
            pipeline_class,
            "",
            f"{type(pipeline).__name__} is neither a diffusers pipeline (a `components` dict) nor an nn.Module",
        )

    absent = declared_absent(pipeline, declared)
    extra = _declared_modules(pipeline, {p: o for p, o in declared.items() if p not in absent}, pipeline_class)
    out: dict[str, nn.Module] = {}
    for name, module in base:
        inside = [p for p in extra if p.startswith(name + ".")]
        if inside:  # the declared sub-components stand in for the module that holds them
            out.update((p, extra[p]) for p in inside)
        elif isinstance(module, nn.Module):
            out[name] = module
    for path, module in extra.items():
        out.setdefault(path, module)
    return out


def declared_absent(root: Any, declared: Collection[str]) -> dict[str, str]:
    """Declared path -> what stands there instead, for each path the instance does not hold: None (diffusers'
    optional components that are not loaded) or a missing attribute anywhere along the path."""
    absent: dict[str, str] = {}
    for path in declared:
        try:
            if lookup(root, path) is None:
                absent[path] = "it is None"
        except AttributeError as e:
            absent[path] = str(e)
    return absent


def _declared_modules(pipeline: Any, declared: Mapping[str, str], pipeline_class: str) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {}
    for path, origin in declared.items():
        module = lookup(pipeline, path)
        if not isinstance(module, nn.Module):
            raise resolution_error(
                pipeline_class, path, f"declared in {origin} but it is {type(module).__name__}; expected an nn.Module"
            )
        modules[path] = module
    for path in modules:
        for other in modules:
            if other.startswith(path + "."):
                raise resolution_error(
                    pipeline_class,
                    other,
                    f"declared as a component ({declared[other]}) inside another declared component {path!r} "
                    f"({declared[path]}); components may not nest",
                )
    return modules


def categorize(
    path: str,
    *,
    dit_paths: Collection[str],
    encoder_types: Mapping[str, str],
    encoder_modules: Collection[str],
    vae_modules: Collection[str],
    listed_roles: Collection[str] = (),
) -> str:
    """The component's category: declarations first, then the name rule on the leaf name. A role the pipeline
    lists (`listed_roles`: "dit" for ``_dit_modules``, "encoder" for ``_encoder_modules``, "vae" for
    ``_vae_modules``) is given by its list alone: with ``_dit_modules`` declared, an undeclared child named
    ``transformer`` is not a DiT (a listed encoder named as a text encoder is still a text encoder)."""
    if path in dit_paths:
        return "dit"
    if path in encoder_types:
        return encoder_types[path]
    leaf = path.rsplit(".", 1)[-1]
    if leaf.startswith("text_encoder") or leaf.endswith("text_encoder"):
        if "encoder" not in listed_roles or path in encoder_modules:
            return "text_encoder"
    if path in encoder_modules:
        return "encoder"
    if leaf.startswith("transformer") and "dit" not in listed_roles:
        return "dit"
    if path in vae_modules or (leaf.startswith("vae") and "vae" not in listed_roles):
        return "vae"
    if leaf.startswith("image_encoder"):
        return "image_encoder"
    return "other"


def block_list_at(
    pipeline_class: str, component: nn.Module, component_path: str, attr_path: str, origin: str
) -> nn.Module:
    """The declared block list `attr_path` inside `component`, checked to be a non-empty ModuleList/Sequential.

    Properties are refused before they are read: a property may build a new list on each access (hooks
    installed on it would be lost), and reading it could run arbitrary code.
    """
    obj: Any = component
    walked = component_path
    for part in attr_path.split("."):
        walked = join_path(walked, part)
        static = inspect.getattr_static(type(obj), part, None)
        if isinstance(static, (property, functools.cached_property)):
            raise resolution_error(
                pipeline_class,
                walked,
                f"declared in {origin} but {part!r} is a property of {type(obj).__name__}; declare the attribute "
                "that holds the nn.ModuleList itself",
            )
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise resolution_error(
                pipeline_class, walked, f"declared in {origin} but {type(obj).__name__} has no attribute {part!r}"
            ) from e
    full = join_path(component_path, attr_path)
    if not isinstance(obj, BLOCK_LIST_TYPES):
        problem = f"declared in {origin} but it is {type(obj).__name__}; expected nn.ModuleList or nn.Sequential"
        raise resolution_error(pipeline_class, full, problem)
    if len(obj) == 0:
        problem = f"declared in {origin} but the block list is empty; it needs at least one block"
        raise resolution_error(pipeline_class, full, problem)
    return obj


def class_block_attrs(module: nn.Module, pipeline_class: str, path: str) -> tuple[str, ...] | None:
    """The model class's ``_layerwise_offload_blocks_attrs``, or None when the class does not declare it."""
    value = _declared_block_attrs(module)
    if value is None:
        return None
    name = f"{type(module).__name__}.{CLASS_BLOCK_ATTRS}"
    return _attribute_paths(pipeline_class, path, name, value, (list, tuple), "a list such as ['blocks']") or None


def repeated_block_classes(module: nn.Module) -> frozenset[str]:
    """Class names the model itself calls its repeated blocks.

    diffusers' ``_repeated_blocks`` is preferred: its ``_no_split_modules`` may also name one-off modules that
    happen to sit in lists (WanAnimate's motion-encoder blocks). transformers models only have the latter.
    """
    for attr in ("_repeated_blocks", "_no_split_modules"):
        names = getattr(module, attr, None)
        if isinstance(names, (list, tuple, set, frozenset)):
            valid = frozenset(n for n in names if isinstance(n, str))
            if valid:
                return valid
    return frozenset()


def find_block_lists(module: nn.Module, skip: Collection[nn.Module] = ()) -> tuple[str, ...]:
    """Attribute paths (definition order) of the ModuleLists/Sequentials under `module` whose items are all
    blocks: instances of `repeated_block_classes(module)`, or wrappers around exactly one such instance.
    Found lists are not searched inside, nor are `skip` modules.

    Wrappers are streamed whole (HiDream's ``HiDreamBlock`` holds one ``HiDreamImageTransformerBlock``): the
    model calls the wrapper, so its hooks see every call, and the wrapper's own tensors travel with the block.
    """
    names = repeated_block_classes(module)
    if not names:
        return ()
    skip_ids = {id(m) for m in skip}
    seen: set[int] = set()
    found: list[str] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in skip_ids or id(child) in seen:
                continue
            seen.add(id(child))
            path = join_path(prefix, name)
            if isinstance(child, BLOCK_LIST_TYPES) and len(child) > 0 and all(_is_block(b, names) for b in child):
                found.append(path)
            else:
                visit(path, child)

    visit("", module)
    return tuple(found)


def has_own_block_lists(module: nn.Module) -> bool:
    """True when `module` is a model by itself: it declares its block lists or they are discoverable."""
    return bool(_declared_block_attrs(module)) or bool(find_block_lists(module))


def _is_one_of(module: nn.Module, class_names: frozenset[str]) -> bool:
    return any(cls.__name__ in class_names for cls in type(module).__mro__)


def _is_block(item: nn.Module, class_names: frozenset[str]) -> bool:
    """A list item is a block when it is one of `class_names`, or wraps exactly one of them one level down
    (a wrapper holding two would merge two blocks into one streamed unit, which the model did not declare)."""
    if _is_one_of(item, class_names):
        return True
    return sum(_is_one_of(child, class_names) for child in item.children()) == 1


def defines_own_to(module: nn.Module) -> str | None:
    """``"<Class>.to"`` where the module's class defines its own ``to()`` (vllm-omni's staged encoders and VAEs
    stage their weights there), else None: torch's ``nn.Module.to``, or one of `FORWARDING_TO_CLASSES`."""
    for cls in type(module).__mro__:
        if "to" in cls.__dict__:
            if cls is nn.Module or f"{cls.__module__}.{cls.__qualname__}" in FORWARDING_TO_CLASSES:
                return None
            return f"{cls.__qualname__}.to"
    return None


def vision_tower_paths(module: nn.Module) -> tuple[str, ...]:
    """Attribute paths of the vision towers inside a vision-language model: the outermost submodules built from
    its ``config.vision_config`` (transformers builds the tower from that sub-config: Qwen2-VL's and Qwen2.5-VL's
    ``model.visual``, Llava's and Mistral3's ``model.vision_tower``). () for a model without one."""
    vision = getattr(getattr(module, "config", None), "vision_config", None)
    if vision is None:
        return ()
    found: list[str] = []
    for name, sub in module.named_modules():
        if name and getattr(sub, "config", None) is vision and not any(name.startswith(p + ".") for p in found):
            found.append(name)
    return tuple(found)


def hands_encoder_images(pipeline: Any) -> bool:
    """Whether the pipeline hands its text encoders an image, so that a vision-language encoder runs its vision
    tower: its ``encode_prompt`` takes one (`IMAGE_ARGUMENTS`); a pipeline without ``encode_prompt`` where its own
    call does (``forward`` for an nn.Module pipeline, else ``__call__``).

    ``encode_prompt`` decides where there is one, not the call: Qwen-Image img2img and EasyAnimate inpainting take
    an image but encode the prompt from text alone (their encoders' vision towers never run), Qwen-Image-Edit
    takes one and hands it to Qwen2.5-VL. Unreadable signatures count as handing one (nothing changes then).
    """
    call = "forward" if isinstance(pipeline, nn.Module) else "__call__"
    for name in ("encode_prompt", call):
        fn = getattr(pipeline, name, None)
        if not callable(fn):
            continue
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return True
        return any(arg in parameters for arg in IMAGE_ARGUMENTS)
    return False


def resident_parts(module: nn.Module, streamed_lists: Collection[str]) -> list[tuple[str, int]]:
    """(attribute path, bytes) of what stays on the device when the block lists at `streamed_lists` (attribute
    paths inside `module`) stream: the outermost submodules holding none of them, and ``""`` for tensors the
    modules on the way hold themselves; largest first, parts without tensors left out."""
    parts: list[tuple[str, int]] = []
    own = 0

    def visit(prefix: str, parent: nn.Module) -> None:
        nonlocal own
        held = chain(parent._parameters.values(), parent._buffers.values())
        own += sum(t.numel() * t.element_size() for t in held if t is not None)
        for name, child in parent.named_children():
            path = join_path(prefix, name)
            if path in streamed_lists:
                continue
            if any(s.startswith(path + ".") for s in streamed_lists):
                visit(path, child)
            elif (nbytes := tensor_bytes(child)) > 0:
                parts.append((path, nbytes))

    visit("", module)
    if own:
        parts.append(("", own))
    return sorted(parts, key=lambda part: -part[1])
