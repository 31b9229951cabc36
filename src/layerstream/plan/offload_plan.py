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


@dataclass(frozen=True)
class OffloadPlan:
    """Which modules of a pipeline hold streamable block lists. Every field is optional.

    Paths are attribute paths from the pipeline (``"transformer"``) or, for block lists, from the component
    (``"blocks"``, ``"encoder.layers"``); dotted paths are allowed.
    """

    block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """DiT path -> block-list attribute paths inside it."""
    offload_submodules: Mapping[str, str] = field(default_factory=dict)
    """Child of a DiT (``"transformer.context_encoder"``) -> its block-list attribute, streamed with its own hooks."""
    resident_dit_paths: frozenset[str] = frozenset()
    """DiTs whose leading blocks may stay on the device (``resident_layers``)."""
    encoder_component_types: Mapping[str, str] = field(default_factory=dict)
    """Encoder path -> public selector type; only ``"text_encoder"`` exists."""
    encoder_block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Encoder path -> streamable block-list attribute paths inside it."""
    encoder_dlo_weight_replication: frozenset[str] = frozenset()
    """Encoders whose block tensors are identical on every rank (the only ones allowed to use allgather)."""
    on_demand_component_paths: frozenset[str] = frozenset()
    """Components that manage their own residency (``load_to_device()`` / ``offload_to_cpu()``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("block_attrs", "encoder_block_attrs"):
                normalized = _frozen_map(_path_tuples(f.name, value))
            elif f.name == "offload_submodules":
                normalized = _frozen_map(_str_map(f.name, value))
            elif f.name == "encoder_component_types":
                normalized = _frozen_map(_str_map(f.name, value))
            else:
                normalized = _str_set(f.name, value)
            object.__setattr__(self, f.name, normalized)

    def __hash__(self) -> int:
        # Order-free, so that equal plans (dicts given in a different order) hash equal.
        return hash(tuple(_hashable(getattr(self, f.name)) for f in fields(self)))

    def __reduce__(self):
        # mappingproxy cannot be pickled or deep-copied; rebuild from plain data instead.
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return (_rebuild, (type(self), {k: dict(v) if isinstance(v, Mapping) else v for k, v in state.items()}))


def _hashable(value: Any) -> Any:
    return frozenset(value.items()) if isinstance(value, Mapping) else value


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


def _str_set(name: str, value: Any) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, (set, frozenset, tuple, list)):
        raise _fail(name, value, "a frozenset of str")
    for item in value:
        if not isinstance(item, str) or not item:
            raise _fail(name, value, f"a frozenset of non-empty str (holds {item!r})")
    return frozenset(value)


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
