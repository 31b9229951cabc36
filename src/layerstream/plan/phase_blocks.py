"""The modules whose forwards price each phase of a generation on the device (pure: nothing moves): each DiT's first
block (the denoising) and each text encoder's first streamable block, else the whole encoder (the prompt
encoding), found by the resolver whatever the config streams. `models.generation_estimates` prices them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from layerstream.config.offload_config import parse_offload_config
from layerstream.plan.resolved import OffloadPlanResolutionError, lookup
from layerstream.plan.resolver import resolve_offload_plan


@dataclass(frozen=True)
class PhaseBlocks:
    dit_blocks: tuple[nn.Module, ...]
    text_encoder_blocks: tuple[nn.Module, ...]


def phase_blocks(pipeline: Any) -> PhaseBlocks:
    try:
        plan = resolve_offload_plan(pipeline, parse_offload_config({"mode": "layer", "components": ["dit", "text_encoder"]}))
    except OffloadPlanResolutionError:  # no text encoder (a caller that passes prompt embeddings)
        plan = resolve_offload_plan(pipeline, parse_offload_config({"mode": "layer", "components": ["dit"]}))
    dits = [lookup(pipeline, s.block_paths[0]) for c in plan.streamed if c.category == "dit" for s in c.stacks if s.block_paths]
    texts: list[nn.Module] = []
    for comp in plan.components:
        if comp.category == "text_encoder":
            firsts = [s.block_paths[0] for s in comp.stacks if s.block_paths]
            texts += [lookup(pipeline, p) for p in firsts] if firsts else [lookup(pipeline, comp.path)]
    return PhaseBlocks(tuple(dits), tuple(texts))
