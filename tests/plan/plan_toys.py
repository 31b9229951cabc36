"""Toy modules and helpers shared by the resolver tests: tiny pipelines whose layout each test controls."""

from __future__ import annotations

import re

import pytest
from torch import nn

from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolved import OffloadPlanResolutionError

DIT = {"mode": "layer", "components": ["dit"]}
TEXT = {"mode": "layer", "components": ["text_encoder"]}
BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}


def layer(*components: str, **options) -> dict:
    """A layer-mode config; keyword arguments are the layer_options per component."""
    config = {"mode": "layer", "components": list(components)}
    if options:
        config["layer_options"] = options
    return config


# --- toy modules -----------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, dim)


class OtherBlock(Block):
    """Not a subclass any toy model names as its repeated block... except through `Block` (MRO)."""


class ToyDiT(nn.Module):
    """A DiT that names its repeated block class, the way diffusers models do."""

    _repeated_blocks = ["Block"]

    def __init__(self, num_blocks: int = 2):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.norm_out = nn.LayerNorm(4)


class DeclaredDiT(ToyDiT):
    """Declares its block list; automatic discovery would also find `extra_blocks`."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, num_blocks: int = 2):
        super().__init__(num_blocks)
        self.extra_blocks = nn.ModuleList(Block() for _ in range(2))


class PlainDiT(nn.Module):
    """A DiT with a block list but nothing that names it."""

    def __init__(self, num_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))


class ContextDiT(ToyDiT):
    """A DiT with a child that has a block list of its own (streamed through `offload_submodules`)."""

    def __init__(self):
        super().__init__()
        self.context_encoder = nn.Module()
        self.context_encoder.blocks = nn.ModuleList(Block() for _ in range(2))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))


class PromptModel(nn.Module):
    """A text encoder whose block list sits at ``encoder.layers``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.encoder = Encoder()


class DeclaredEncoder(PromptModel):
    _layerwise_offload_blocks_attrs = ["encoder.layers"]


class OnDemand(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def load_to_device(self):
        raise AssertionError("the resolver must not call this")

    def offload_to_cpu(self):
        raise AssertionError("the resolver must not call this")


class ToyPipeline(nn.Module):
    """An nn.Module pipeline whose components are its children."""

    def __init__(self, **children: nn.Module | None):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


def pipeline_class(name: str, base: type = ToyPipeline, **class_attrs) -> type:
    """A pipeline class named `name` (error messages name it) with the given class attributes."""
    return type(name, (base,), class_attrs)


class MyPipeline(nn.Module):
    """The vllm-omni style example, exactly as a model author writes it."""

    _encoder_modules = ["prompt_model"]
    _offload_plan = OffloadPlan(
        encoder_component_types={"prompt_model": "text_encoder"},
        encoder_block_attrs={"prompt_model": ("encoder.layers",)},
    )

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.prompt_model = PromptModel()
        self.transformer = transformer


def stack_names(comp) -> list[str]:
    return [s.qualified_name for s in comp.stacks]


def raises_naming(*fragments: str):
    """pytest.raises for OffloadPlanResolutionError whose message contains every fragment."""
    return pytest.raises(OffloadPlanResolutionError, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))
