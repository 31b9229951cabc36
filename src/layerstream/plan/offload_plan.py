"""`OffloadPlan`: a model's declaration of what may stream (API-compatible with vllm-omni's offloader)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from layerstream.errors import LayerstreamError

ENCODER_TYPES = ("text_encoder",)


class OffloadPlanError(LayerstreamError, TypeError):
    """An `OffloadPlan` built with a field of the wrong type."""


def _frozen_map(value: Mapping) -> Mapping:
    return MappingProxyType(dict(value))


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Which modules of a pipeline hold streamable block lists. Every field is optional and given by keyword. Paths are
    attribute paths from the pipeline (``"transformer"``) or, for block lists, from the component (``"blocks"``,
    ``"encoder.layers"``); dotted paths are allowed. The fields are those of vllm-omni's current `OffloadPlan`; the ones
    naming a feature layerstream does not have (`UNSUPPORTED_FIELDS`) are accepted here and refused when a plan that
    sets them is resolved."""

    block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """DiT path -> block-list attribute paths inside it."""
    offload_submodules: Mapping[str, str] = field(default_factory=dict)
    """A DiT's child (``"context_encoder"``, or its pipeline path ``"transformer.context_encoder"``) -> its
    block-list attribute, streamed with its own hooks."""
    resident_dit_paths: frozenset[str] = frozenset()
    """DiTs whose leading blocks may stay on the device (``resident_layers``)."""
    encoder_component_types: Mapping[str, str] = field(default_factory=dict)
    """Encoder path -> public selector type; only ``"text_encoder"`` exists."""
    encoder_block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Encoder path -> streamable block-list attribute paths inside it."""
    encoder_dlo_weight_replication: frozenset[str] = frozenset()
    """Encoders whose block tensors are identical on every rank (the only ones allowed to use allgather)."""
    on_demand_component_paths: frozenset[str] = frozenset()
    """Components that manage their own residency (``load_to_device()`` / ``offload_to_cpu()``): where one is
    selected in layer mode, enabling calls ``offload_to_cpu()`` once (and streams its blocks, if it has any) and
    disabling calls ``load_to_device()`` once; elsewhere it is handled like any other component."""
    layerwise_resident_layers: Mapping[str, int] | int = field(default_factory=dict)
    """DiT path -> leading blocks the model keeps on the device by default (an int: for every DiT in
    ``resident_dit_paths``); ``layer_options.dit.resident_layers`` in the config overrides it."""
    resident_paths: tuple[str, ...] = ()
    """Modules (pipeline paths) that always stay on the device: a component listed here is never streamed or
    swapped; a module inside a component must lie outside whatever moves (its streamed blocks)."""
    components: tuple[Any, ...] = ()
    """vllm-omni's per-component specs; layerstream has no such declaration (refused when set)."""
    phases: tuple[Any, ...] = ()
    """vllm-omni's named execution phases; layerstream has none (refused when set)."""
    legacy_selections: tuple[Any, ...] = ()
    """vllm-omni's targets for a config without a component selector; layerstream's config always names its
    components (refused when set)."""
    encoder_host_resident_table_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """vllm-omni's lookup tables left in host memory; layerstream has no such placement (refused when set)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if args:  # field order differs between vllm-omni versions, so a positional plan has no one meaning
            names = ", ".join(f.name for f in fields(cls)[:3])
            raise OffloadPlanError(
                f"OffloadPlan takes keyword arguments only ({names}, ...); got {len(args)} positional "
                f"argument(s): {_short(args)}"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _NORMALIZERS[f.name](f.name, getattr(self, f.name)))

    def __hash__(self) -> int:
        # Order-free, so that equal plans (dicts given in a different order) hash equal.
        values = (getattr(self, f.name) for f in fields(self))
        return hash(tuple(frozenset(v.items()) if isinstance(v, Mapping) else v for v in values))

    def __reduce__(self):
        # mappingproxy cannot be pickled or deep-copied; rebuild from plain data instead.
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return (_rebuild, (type(self), {k: dict(v) if isinstance(v, Mapping) else v for k, v in state.items()}))


UNSUPPORTED_FIELDS: Mapping[str, str] = MappingProxyType({
    "components": "per-component specs (OffloadComponentSpec)",
    "phases": "named execution phases",
    "legacy_selections": "targets for a config that names no components",
    "encoder_host_resident_table_attrs": "lookup tables left in host memory",
})  # fmt: skip
"""Fields of vllm-omni's `OffloadPlan` whose feature layerstream lacks -> that feature, in words. A plan that
sets one (to anything but its default) is refused at resolution, naming the field: never silently ignored."""


def unsupported_fields(plan: OffloadPlan) -> dict[str, Any]:
    """The fields of `plan` in `UNSUPPORTED_FIELDS` set to something other than their default."""
    return {name: getattr(plan, name) for name in UNSUPPORTED_FIELDS if getattr(plan, name)}


def declared_resident_layers(plan: OffloadPlan) -> dict[str, int]:
    """``layerwise_resident_layers`` as DiT path -> count (an int applies to every path in ``resident_dit_paths``)."""
    counts = plan.layerwise_resident_layers
    if isinstance(counts, int):
        return dict.fromkeys(sorted(plan.resident_dit_paths), counts) if counts else {}
    return dict(counts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _rebuild(cls: type, kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


def _fail(field_name: str, value: Any, expected: str) -> OffloadPlanError:
    return OffloadPlanError(f"OffloadPlan.{field_name} = {value!r} is not valid; expected {expected}")


def _str_map(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise _fail(name, value, "a dict of str -> str")
    for k, v in value.items():
        if not isinstance(k, str) or not k or not isinstance(v, str) or not v:
            raise _fail(name, value, f"a dict of non-empty str -> non-empty str (entry {k!r}: {v!r})")
    return dict(value)


def _path_tuples(name: str, value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise _fail(name, value, "a dict of str -> tuple of attribute paths")
    out: dict[str, tuple[str, ...]] = {}
    for k, v in value.items():
        if isinstance(v, str):  # a lone path is a common slip; it is not silently split into characters
            raise _fail(name, value, f"a tuple of attribute paths for {k!r}, e.g. ({v!r},), not a bare string")
        if not isinstance(k, str) or not k or not isinstance(v, (tuple, list)) or not v:
            raise _fail(name, value, f"a dict of str -> non-empty tuple of str (entry {k!r}: {v!r})")
        for item in v:
            if not isinstance(item, str) or not item:
                raise _fail(name, value, f"non-empty str attribute paths (entry {k!r} holds {item!r})")
        out[k] = tuple(v)
    return out


def _strs(name: str, value: Any, types: tuple[type, ...], expected: str) -> Any:
    if isinstance(value, str) or not isinstance(value, types):
        raise _fail(name, value, expected)
    for item in value:
        if not isinstance(item, str) or not item:
            raise _fail(name, value, f"{expected} (holds {item!r})")
    return value


def _any_tuple(name: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (tuple, list)):
        raise _fail(name, value, "a tuple")
    return tuple(value)


def _layer_counts(name: str, value: Any) -> Mapping[str, int] | int:
    def is_count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if is_count(value):
        return value
    if not isinstance(value, Mapping):
        raise _fail(name, value, "a dict of DiT path -> int >= 0, or one int >= 0")
    for k, v in value.items():
        if not isinstance(k, str) or not k or not is_count(v):
            raise _fail(name, value, f"a dict of non-empty str -> int >= 0 (entry {k!r}: {v!r})")
    return _frozen_map(value)


def _str_set(name: str, value: Any) -> frozenset[str]:
    return frozenset(_strs(name, value, (set, frozenset, tuple, list), "a frozenset of non-empty str"))


_NORMALIZERS = {
    "block_attrs": lambda n, v: _frozen_map(_path_tuples(n, v)),
    "encoder_block_attrs": lambda n, v: _frozen_map(_path_tuples(n, v)),
    "encoder_host_resident_table_attrs": lambda n, v: _frozen_map(_path_tuples(n, v)),
    "offload_submodules": lambda n, v: _frozen_map(_str_map(n, v)),
    "encoder_component_types": lambda n, v: _frozen_map(_str_map(n, v)),
    "resident_dit_paths": _str_set,
    "encoder_dlo_weight_replication": _str_set,
    "on_demand_component_paths": _str_set,
    "layerwise_resident_layers": _layer_counts,
    "resident_paths": lambda n, v: tuple(dict.fromkeys(_strs(n, v, (tuple, list), "a tuple of non-empty str"))),
    "components": _any_tuple,
    "phases": _any_tuple,
    "legacy_selections": _any_tuple,
}


def get_offload_plan(pipeline: Any) -> OffloadPlan | None:
    """The plan in ``_offload_plan``: the instance's own where it has one (vllm-omni reads it so), else its
    class's; None where neither declares one."""
    plan = getattr(pipeline, "_offload_plan", None)  # the instance's attribute first, then the class's
    if plan is None:
        return None
    if not isinstance(plan, OffloadPlan):
        owner = pipeline if isinstance(pipeline, type) else type(pipeline)
        raise OffloadPlanError(f"{owner.__name__}._offload_plan is {type(plan).__name__}; expected an OffloadPlan or None")
    return plan
