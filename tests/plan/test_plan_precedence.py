"""A pipeline's own declarations win over layerstream's built-in plan, component by component.

A component the pipeline itself describes (its ``_offload_plan``, ``_dit_modules``, ``_encoder_modules``,
``_vae_modules``) takes nothing from the built-in plan: not its category, block lists, submodules, resident
layers or replication. Components the pipeline does not describe keep the built-in plan.
"""

from __future__ import annotations

import pytest
from plan_toys import DIT, TEXT, Block, ContextDiT, ToyPipeline, layer, pipeline_class, raises_naming, stack_names
from torch import nn

import layerstream.plan.declarations as declarations
from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def _wan_22(tiny, plan: OffloadPlan):
    from diffusers import WanPipeline

    cls = pipeline_class("MyWan", base=WanPipeline, _offload_plan=plan)
    return cls(
        tokenizer=None, text_encoder=tiny.get("umt5"), vae=None, scheduler=None,
        transformer=tiny.get("wan"), transformer_2=tiny.get("wan_2"),
    )  # fmt: skip


def test_pipeline_encoder_component_types_win_over_a_builtin_dit(tiny):
    # the built-in Wan plan lists transformer_2 as a DiT; this pipeline says it is a text encoder
    plan = OffloadPlan(
        encoder_component_types={"transformer_2": "text_encoder"}, encoder_block_attrs={"transformer_2": ("blocks",)}
    )
    resolved = resolve_offload_plan(_wan_22(tiny, plan), layer("dit", "text_encoder"))
    second = resolved.component("transformer_2")
    assert (second.category, second.source, second.action) == ("text_encoder", "plan", "stream")
    assert not second.resident_allowed  # the built-in resident_dit_paths entry is set aside with the rest
    first = resolved.component("transformer")
    assert (first.category, first.source, first.resident_allowed) == ("dit", "builtin", True)  # untouched
    assert resolved.component("text_encoder").source == "builtin"
    streamed_dits = [c.path for c in resolve_offload_plan(_wan_22(tiny, plan), DIT).streamed]
    assert streamed_dits == ["transformer"]


def test_an_encoder_the_pipeline_types_takes_no_block_lists_or_replication_from_the_builtin_plan(tiny):
    # typed, but with no block lists of its own: discovered like any other encoder, not from the built-in plan
    plan = OffloadPlan(encoder_component_types={"text_encoder": "text_encoder"})
    comp = resolve_offload_plan(_wan_22(tiny, plan), TEXT).component("text_encoder")
    assert (comp.category, comp.source, comp.action) == ("text_encoder", "auto", "stream")
    assert stack_names(comp) == ["text_encoder.encoder.block"]
    # the built-in plan's replication promise does not carry over to a component the pipeline describes
    assert not comp.replicated
    with raises_naming("text_encoder", "encoder_dlo_weight_replication"):
        resolve_offload_plan(_wan_22(tiny, plan), layer("text_encoder", text_encoder={"weight_transfer": "allgather"}))
    replicated = OffloadPlan(
        encoder_component_types={"text_encoder": "text_encoder"},
        encoder_dlo_weight_replication=frozenset({"text_encoder"}),
    )
    assert resolve_offload_plan(_wan_22(tiny, replicated), TEXT).component("text_encoder").replicated


def test_role_lists_that_disagree_with_the_builtin_plan_win(tiny):
    from diffusers import WanPipeline

    # _encoder_modules puts transformer_2, a DiT in the built-in plan, among the encoders
    cls = pipeline_class("MyWanEncoders", base=WanPipeline, _encoder_modules=["transformer_2"])
    pipe = cls(
        tokenizer=None, text_encoder=tiny.get("umt5"), vae=None, scheduler=None,
        transformer=tiny.get("wan"), transformer_2=tiny.get("wan_2"),
    )  # fmt: skip
    resolved = resolve_offload_plan(pipe, DIT)
    assert (resolved.component("transformer_2").category, resolved.component("transformer_2").action) == (
        "encoder",
        "resident",
    )
    assert resolved.component("transformer").source == "builtin"


def test_role_lists_that_agree_with_the_builtin_plan_keep_its_block_lists(tiny):
    from diffusers import HunyuanVideoImageToVideoPipeline

    # automatic discovery finds nothing in the token-replace transformer: only the built-in plan can stream it
    cls = pipeline_class("MyHunyuanI2V", base=HunyuanVideoImageToVideoPipeline, _dit_modules=["transformer"])
    unused = ("text_encoder", "tokenizer", "vae", "scheduler", "text_encoder_2", "tokenizer_2", "image_processor")
    pipe = cls(**dict.fromkeys(unused), transformer=tiny.get("hunyuan_token_replace"))
    comp = resolve_offload_plan(pipe, DIT).component("transformer")
    assert (comp.source, comp.action, comp.resident_allowed) == ("builtin", "stream", True)


class TwoListContextDiT(ContextDiT):
    """A context encoder with two block lists, so that two plans can pick different ones."""

    def __init__(self):
        super().__init__()
        self.context_encoder.early_blocks = nn.ModuleList(Block() for _ in range(2))


@pytest.fixture
def builtin_with_submodules(monkeypatch):
    """A built-in plan for `BuiltinContextPipeline` that streams the context encoder's ``blocks``."""
    builtin = OffloadPlan(
        block_attrs={"transformer": ("blocks",)},
        offload_submodules={"transformer.context_encoder": "blocks"},
        resident_dit_paths=frozenset({"transformer"}),
    )
    real = declarations.builtin_plan_for
    monkeypatch.setattr(
        declarations,
        "builtin_plan_for",
        lambda pipeline: builtin if type(pipeline).__name__.startswith("BuiltinContext") else real(pipeline),
    )
    return builtin


def test_builtin_offload_submodules_apply_when_the_pipeline_declares_none(builtin_with_submodules):
    cls = pipeline_class("BuiltinContextPipeline")
    comp = resolve_offload_plan(cls(transformer=TwoListContextDiT()), DIT).component("transformer")
    assert comp.source == "builtin"
    assert stack_names(comp) == ["transformer.blocks", "transformer.context_encoder.blocks"]


def test_pipeline_offload_submodules_win_over_the_builtin_plan(builtin_with_submodules):
    own = OffloadPlan(offload_submodules={"transformer.context_encoder": "early_blocks"})
    cls = pipeline_class("BuiltinContextOwnSubmodules", _offload_plan=own)
    comp = resolve_offload_plan(cls(transformer=TwoListContextDiT()), DIT).component("transformer")
    assert stack_names(comp) == ["transformer.blocks", "transformer.context_encoder.early_blocks"]
    assert [s.own_chain for s in comp.stacks] == [False, True]


def test_a_dit_the_pipeline_describes_takes_no_submodules_from_the_builtin_plan(builtin_with_submodules):
    # the pipeline's own block_attrs describe the whole DiT; the built-in submodule would overlap nothing here,
    # but it is the built-in plan's idea of this DiT, so it is set aside
    own = OffloadPlan(block_attrs={"transformer": ("blocks",)})
    cls = pipeline_class("BuiltinContextOwnDiT", _offload_plan=own)
    comp = resolve_offload_plan(cls(transformer=TwoListContextDiT()), DIT).component("transformer")
    assert (comp.source, stack_names(comp)) == ("plan", ["transformer.blocks"])
    assert not comp.resident_allowed  # nor its resident_dit_paths


def test_untouched_components_keep_the_builtin_plan_beside_a_pipeline_plan(tiny):
    plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})
    resolved = resolve_offload_plan(_wan_22(tiny, plan), layer("dit", "text_encoder"))
    assert resolved.component("transformer").source == "plan"
    second, text = resolved.component("transformer_2"), resolved.component("text_encoder")
    assert (second.source, second.resident_allowed) == ("builtin", True)
    assert (text.source, text.replicated) == ("builtin", True)


def test_toy_pipeline_without_builtin_plan_is_unaffected():
    comp = resolve_offload_plan(ToyPipeline(transformer=ContextDiT()), DIT).component("transformer")
    assert (comp.source, stack_names(comp)) == ("auto", ["transformer.blocks", "transformer.context_encoder.blocks"])
