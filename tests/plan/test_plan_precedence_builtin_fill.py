"""A pipeline's own `_offload_plan` wins over layerstream's built-in plan, field by field: its
`offload_submodules` and its encoder declarations (`encoder_component_types`, `encoder_block_attrs`) replace the
built-in plan's for the same paths, and the built-in plan still fills in what the pipeline leaves out."""

from __future__ import annotations

import pytest
from plan_toys import BOTH, Block, PromptModel, ToyDiT, pipeline_class, stack_names
from torch import nn

from layerstream.plan import declarations
from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

BUILTIN = OffloadPlan(
    block_attrs={"transformer": ("blocks",)},
    resident_dit_paths=frozenset({"transformer"}),
    offload_submodules={"transformer.context_encoder": "coarse_blocks"},
    encoder_component_types={"text_encoder": "text_encoder"},
    encoder_block_attrs={"text_encoder": ("embed_layers",)},
)


class ContextDiT(ToyDiT):
    def __init__(self):
        super().__init__()
        self.context_encoder = nn.Module()
        self.context_encoder.coarse_blocks = nn.ModuleList(Block() for _ in range(2))
        self.context_encoder.fine_blocks = nn.ModuleList(Block() for _ in range(3))


class TwoListEncoder(PromptModel):
    def __init__(self):
        super().__init__()
        self.embed_layers = nn.ModuleList(Block() for _ in range(2))


@pytest.fixture
def builtin_plan(monkeypatch):
    """Pretend layerstream ships BUILTIN for the pipeline classes of this file."""
    monkeypatch.setattr(declarations, "builtin_plan_for", lambda pipeline: BUILTIN)


def _pipeline(own_plan: OffloadPlan | None):
    attrs = {"_offload_plan": own_plan} if own_plan is not None else {}
    cls = pipeline_class("BuiltinBackedPipeline", **attrs)
    return cls(transformer=ContextDiT(), text_encoder=TwoListEncoder(), prompt_model=TwoListEncoder())


def test_without_an_own_plan_the_builtin_plan_applies(builtin_plan):
    resolved = resolve_offload_plan(_pipeline(None), BOTH)
    dit = resolved.component("transformer")
    assert stack_names(dit) == ["transformer.blocks", "transformer.context_encoder.coarse_blocks"]
    encoder = resolved.component("text_encoder")
    assert (encoder.source, stack_names(encoder)) == ("builtin", ["text_encoder.embed_layers"])


def test_the_pipelines_own_offload_submodules_and_encoder_declarations_win(builtin_plan):
    own = OffloadPlan(
        offload_submodules={"transformer.context_encoder": "fine_blocks"},
        encoder_component_types={"text_encoder": "text_encoder", "prompt_model": "text_encoder"},
        encoder_block_attrs={"text_encoder": ("encoder.layers",), "prompt_model": ("embed_layers",)},
    )
    resolved = resolve_offload_plan(_pipeline(own), BOTH)
    dit = resolved.component("transformer")
    # the DiT's own lists still come from the built-in plan; its submodule's list from the pipeline's plan
    assert stack_names(dit) == ["transformer.blocks", "transformer.context_encoder.fine_blocks"]
    sub = dit.stacks[1]
    assert sub.own_chain and sub.num_blocks == 3
    encoder = resolved.component("text_encoder")
    assert (encoder.category, encoder.source, encoder.action) == ("text_encoder", "plan", "stream")
    assert stack_names(encoder) == ["text_encoder.encoder.layers"]
    # a component only the pipeline's plan types as a text encoder (its name alone would not) streams too
    prompt = resolved.component("prompt_model")
    assert (prompt.category, prompt.source, prompt.action) == ("text_encoder", "plan", "stream")
    assert stack_names(prompt) == ["prompt_model.embed_layers"]
