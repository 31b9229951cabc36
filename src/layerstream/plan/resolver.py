"""`resolve_offload_plan`: the one reader of offload plans; pure, so every backend can trust its answer.

Three passes over plain data, reading modules only: find the components and their block lists (`plan.found`,
through `plan.declarations`), check what does not depend on the config (`plan.checks`), decide what the config
does with each (`plan.decisions`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layerstream.config.offload_config import OffloadConfig, parse_offload_config
from layerstream.plan.checks import (
    check_block_claims,
    check_on_demand_methods,
    check_resident_paths,
    check_selection,
)
from layerstream.plan.declarations import Declarations
from layerstream.plan.decisions import decide_component
from layerstream.plan.discovery import tensor_bytes
from layerstream.plan.found import find_components
from layerstream.plan.resolved import ResolvedOffloadPlan, UntouchedComponent


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

    found, absent, untouched = find_components(pipeline, decl)
    check_block_claims(pipeline_class, found, untouched)
    check_on_demand_methods(pipeline_class, decl, found)
    components = tuple(decide_component(pipeline_class, decl, config, item) for item in found)
    absent += check_resident_paths(pipeline, decl, components, untouched)
    check_selection(pipeline_class, config, found, components, absent)
    return ResolvedOffloadPlan(
        pipeline_class=pipeline_class,
        config=config,
        components=components,
        absent=absent,
        untouched=tuple(UntouchedComponent(p, type(m).__name__, tensor_bytes(m)) for p, m in untouched.items()),
    )
