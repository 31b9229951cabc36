"""`Declarations`: what a pipeline says about its components (its ``_offload_plan``, the instance's else its
class's; its role lists; its ``_resident_modules``) and layerstream's built-in plan for its class, read in precedence
order for the resolver. Only reads attributes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from layerstream.plan.builtin_plans import builtin_family_for, builtin_plan_for
from layerstream.plan.discovery import RESIDENT_LIST, ROLE_LISTS, declared_paths, resolution_error
from layerstream.plan.offload_plan import (
    ENCODER_TYPES,
    UNSUPPORTED_FIELDS,
    OffloadPlan,
    declared_resident_layers,
    get_offload_plan,
    unsupported_fields,
)


class Declarations:
    """The pipeline's own plan and layerstream's built-in plan, read in precedence order. The pipeline wins component by
    component. A component its ``_offload_plan`` describes (``block_attrs``, ``encoder_component_types`` or
    ``encoder_block_attrs``) is described by the pipeline alone: the built-in plan's entries for it (category, block
    lists, submodules inside it, resident layers, replication) are set aside, so the two descriptions never mix. A
    component its role lists (``_dit_modules``, ``_encoder_modules``, ``_vae_modules``) put in another role than the
    built-in plan does loses its built-in entries too; where the roles agree, the built-in plan still supplies the block
    lists."""

    def __init__(self, pipeline: Any, pipeline_class: str):
        self.pipeline_class = pipeline_class
        self.plan = get_offload_plan(pipeline) or OffloadPlan()
        self.dit_modules = declared_paths(pipeline, "_dit_modules", pipeline_class)
        self.encoder_modules = declared_paths(pipeline, "_encoder_modules", pipeline_class)
        self.vae_modules = declared_paths(pipeline, "_vae_modules", pipeline_class)
        self.resident_modules = declared_paths(pipeline, RESIDENT_LIST, pipeline_class)
        self.declares_roles = all(getattr(pipeline, attr, None) is not None for attr in ROLE_LISTS)
        """All three role lists set (vllm-omni's `SupportsComponentDiscovery`): the lists, ``_resident_modules`` and
        the pipeline's own ``_offload_plan`` are the whole picture, and a child none of them names is left untouched.
        Where only some are set, each set role is given by its list alone and the rest by the name rule."""
        self.listed_roles = frozenset(
            role for role, attr in (("dit", "_dit_modules"), ("encoder", "_encoder_modules"), ("vae", "_vae_modules"))
            if getattr(pipeline, attr, None) is not None
        )
        """The roles the pipeline lists its components for: each of them is given by its list alone, not by name."""
        builtin = builtin_plan_for(pipeline) or OffloadPlan()
        plan = self.plan
        described = set(plan.block_attrs) | set(plan.encoder_component_types) | set(plan.encoder_block_attrs)
        builtin_encoders = set(builtin.encoder_component_types) | set(builtin.encoder_block_attrs)
        recast = (
            {p for p in self.dit_modules if p in builtin_encoders}
            | {p for p in self.encoder_modules if p in builtin.block_attrs}
            | {p for p in self.vae_modules if p in builtin.block_attrs or p in builtin_encoders}
        )
        self.builtin = _without_components(builtin, described | recast)
        self.encoder_types = {**self.builtin.encoder_component_types, **self.plan.encoder_component_types}
        self.dit_paths = frozenset(self.plan.block_attrs) | set(self.builtin.block_attrs) | set(self.dit_modules)
        self.offload_submodules = {**self.builtin.offload_submodules, **self.plan.offload_submodules}
        self.resident_counts = {**declared_resident_layers(self.builtin), **declared_resident_layers(self.plan)}
        """DiT path -> leading blocks its model keeps on the device unless the config says otherwise."""
        family = builtin_family_for(pipeline)
        # only DiTs the built-in plan still describes: one the pipeline redeclared may run otherwise
        self.alternating = frozenset(p for p in (family.alternating_dits if family else ()) if p in self.builtin.block_attrs)

    def component_paths(self) -> dict[str, str]:
        """Every component path a declaration names -> where it was declared (for error messages)."""
        out: dict[str, str] = {}
        for plan, owner in ((self.plan, "_offload_plan"), (self.builtin, "layerstream's built-in plan")):
            for field in ("block_attrs", "encoder_component_types", "encoder_block_attrs"):
                for path in getattr(plan, field):
                    out.setdefault(path, f"{owner}.{field}")
            for path in declared_resident_layers(plan):
                out.setdefault(path, f"{owner}.layerwise_resident_layers")
            for field in ("resident_dit_paths", "encoder_dlo_weight_replication", "on_demand_component_paths"):
                for path in sorted(getattr(plan, field)):
                    out.setdefault(path, f"{owner}.{field}")
        for paths, attr in (
            (self.dit_modules, "_dit_modules"),
            (self.encoder_modules, "_encoder_modules"),
            (self.vae_modules, "_vae_modules"),
        ):
            for path in paths:
                out.setdefault(path, attr)
        return out

    def check(self) -> None:
        """Reject declarations that contradict themselves or ask for what layerstream lacks, before any module is
        read."""
        for name, value in unsupported_fields(self.plan).items():
            raise resolution_error(
                self.pipeline_class,
                f"_offload_plan.{name}",
                f"_offload_plan.{name} = {value!r} declares {UNSUPPORTED_FIELDS[name]}, which layerstream does not "
                f"support; remove it (leave {name} empty) and describe the components with block_attrs, "
                "encoder_block_attrs and the pipeline's role lists",
            )
        counts = self.plan.layerwise_resident_layers
        if isinstance(counts, int) and counts and not self.plan.resident_dit_paths:
            raise resolution_error(
                self.pipeline_class,
                "_offload_plan.layerwise_resident_layers",
                f"_offload_plan.layerwise_resident_layers = {counts} applies to the DiTs in resident_dit_paths, but "
                "it lists none; list them there, or give a dict of DiT path -> count",
            )
        for path, kind in self.plan.encoder_component_types.items():
            if kind not in ENCODER_TYPES:
                allowed = ", ".join(repr(t) for t in ENCODER_TYPES)
                raise resolution_error(
                    self.pipeline_class,
                    path,
                    f"_offload_plan.encoder_component_types[{path!r}] = {kind!r} is not a known encoder type; "
                    f"allowed: {allowed}",
                )
        plan = self.plan
        as_dit = set(plan.block_attrs) | set(self.dit_modules)
        as_encoder = set(plan.encoder_component_types) | set(plan.encoder_block_attrs) | set(self.encoder_modules)
        for path in sorted(as_dit & as_encoder):
            raise resolution_error(
                self.pipeline_class,
                path,
                "declared both as a DiT (block_attrs or _dit_modules) and as an encoder (encoder_component_types, "
                "encoder_block_attrs or _encoder_modules); declare it as one of them",
            )

    def block_attrs(self, path: str, category: str) -> tuple[tuple[str, ...], str, str] | None:
        """(attribute paths, source, origin) a plan declares for this component, or None. DiTs are read from
        ``block_attrs``, every other category from ``encoder_block_attrs``."""
        field = "block_attrs" if category == "dit" else "encoder_block_attrs"
        for plan, source, owner in (
            (self.plan, "plan", "_offload_plan"),
            (self.builtin, "builtin", "layerstream's built-in plan"),
        ):
            attrs = getattr(plan, field).get(path)
            if attrs is not None:
                return attrs, source, f"{owner}.{field}[{path!r}]"
        return None

    def own_component_paths(self) -> frozenset[str]:
        """Every path the pipeline itself names (not the built-in plan): its role lists, ``_resident_modules`` and
        the component fields of its ``_offload_plan``. With `declares_roles`, the only components there are."""
        plan = self.plan
        named = {*self.dit_modules, *self.encoder_modules, *self.vae_modules, *self.resident_modules}
        named |= {*plan.block_attrs, *plan.encoder_component_types, *plan.encoder_block_attrs, *plan.resident_paths}
        named |= {*plan.resident_dit_paths, *declared_resident_layers(plan), *plan.on_demand_component_paths}
        return frozenset(named | plan.encoder_dlo_weight_replication)

    def resident_paths(self) -> dict[str, str]:
        """Module path -> where it was declared, for every module the pipeline keeps on the device: its
        ``_offload_plan.resident_paths``, then its ``_resident_modules`` (vllm-omni's list of the same)."""
        out = dict.fromkeys(self.plan.resident_paths, "_offload_plan.resident_paths")
        for path in self.resident_modules:
            out.setdefault(path, RESIDENT_LIST)
        return out

    def resident_allowed(self, path: str) -> bool:
        return path in self.plan.resident_dit_paths or path in self.builtin.resident_dit_paths or path in self.resident_counts

    def declared_resident(self, path: str) -> str | None:
        """Where the pipeline declares `path` (or a module holding it) kept on the device (`resident_paths`), or
        None."""
        for p, origin in self.resident_paths().items():
            if path == p or path.startswith(p + "."):
                return origin
        return None

    def replicated(self, path: str) -> bool:
        return path in self.plan.encoder_dlo_weight_replication or path in self.builtin.encoder_dlo_weight_replication

    @property
    def on_demand_paths(self) -> frozenset[str]:
        return self.plan.on_demand_component_paths | self.builtin.on_demand_component_paths


def _without_components(plan: OffloadPlan, paths: set[str]) -> OffloadPlan:
    """`plan` with every entry about the components in `paths` (and about submodules inside them) removed."""

    def outside(path: str) -> bool:
        return not any(path == p or path.startswith(p + ".") for p in paths)

    kept: dict[str, Any] = {}
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if isinstance(value, Mapping):
            kept[f.name] = {k: v for k, v in value.items() if outside(k)}
        elif isinstance(value, frozenset) or f.name == "resident_paths":
            kept[f.name] = type(value)(filter(outside, value))
    return dataclasses.replace(plan, **kept)
