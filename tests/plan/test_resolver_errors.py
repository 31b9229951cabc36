"""`resolve_offload_plan` errors: each names the pipeline class and the path, the value seen and what is allowed."""

from __future__ import annotations

import pytest
from plan_toys import (
    BOTH,
    DIT,
    TEXT,
    Block,
    DeclaredDiT,
    DeclaredEncoder,
    MyPipeline,
    PlainDiT,
    PromptModel,
    ToyDiT,
    ToyPipeline,
    layer,
    pipeline_class,
    raises_naming,
)
from torch import nn

from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolved import OffloadPlanResolutionError
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_resolution_errors_are_value_errors():
    assert issubclass(OffloadPlanResolutionError, ValueError)


@pytest.mark.parametrize(
    ("attrs", "fragments"),
    [
        (("missing",), ("transformer.missing", "no attribute")),
        (("embed",), ("transformer.embed", "Linear", "nn.ModuleList or nn.Sequential")),
        (("norm_out.weight",), ("transformer.norm_out.weight", "Parameter")),
        (("empty",), ("transformer.empty", "empty")),
    ],
)
def test_declared_block_attribute_errors(attrs, fragments):
    dit = ToyDiT()
    dit.empty = nn.ModuleList()
    cls = pipeline_class("DeclaredPipeline", _offload_plan=OffloadPlan(block_attrs={"transformer": attrs}))
    with raises_naming("DeclaredPipeline", *fragments):
        resolve_offload_plan(cls(transformer=dit), DIT)


def test_class_attribute_errors_name_the_class_and_path():
    class BadDiT(ToyDiT):
        _layerwise_offload_blocks_attrs = ["no_such_list"]

    with raises_naming("ToyPipeline", "transformer.no_such_list", "BadDiT._layerwise_offload_blocks_attrs"):
        resolve_offload_plan(ToyPipeline(transformer=BadDiT()), DIT)

    class StringDiT(ToyDiT):
        _layerwise_offload_blocks_attrs = "blocks"

    with raises_naming("ToyPipeline", "transformer", "expected a list"):
        resolve_offload_plan(ToyPipeline(transformer=StringDiT()), DIT)


def test_a_declared_component_that_does_not_exist_is_skipped_and_named_when_the_selection_fails():
    # declared but absent is skipped, as vllm-omni skips it (tests/plan/test_vllm_omni_compat_more.py); where
    # nothing else fits the selection, the error names the absent declaration
    cls = pipeline_class("TypoPipeline", _offload_plan=OffloadPlan(block_attrs={"transformr": ("blocks",)}))
    assert [a.path for a in resolve_offload_plan(cls(transformer=ToyDiT()), DIT).absent] == ["transformr"]
    with raises_naming("TypoPipeline", "no dit component", "declared but absent: transformr", "_offload_plan.block_attrs"):
        resolve_offload_plan(cls(proj=nn.Linear(2, 2)), DIT)


def test_a_block_claimed_by_two_stacks():
    dit = ToyDiT()
    dit.alias = dit.blocks  # the same list under a second name
    plan = OffloadPlan(block_attrs={"transformer": ("blocks", "alias")})
    cls = pipeline_class("TwiceDeclaredPipeline", _offload_plan=plan)
    with raises_naming("TwiceDeclaredPipeline", "transformer.alias.0", "transformer.blocks.0"):
        resolve_offload_plan(cls(transformer=dit), DIT)


def test_nested_block_lists_claim_a_module_twice():
    dit = ToyDiT()
    dit.blocks[0].inner = nn.ModuleList([Block()])
    plan = OffloadPlan(block_attrs={"transformer": ("blocks", "blocks.0.inner")})
    cls = pipeline_class("NestedListsPipeline", _offload_plan=plan)
    with raises_naming("NestedListsPipeline", "transformer.blocks.0.inner.0", "transformer.blocks.0"):
        resolve_offload_plan(cls(transformer=dit), DIT)


def test_a_block_claimed_by_two_components(tiny):
    shared = tiny.get("wan")
    pipe = tiny.pipeline("WanPipeline", transformer=shared, transformer_2=shared, text_encoder="umt5")
    with raises_naming("WanPipeline", "transformer_2.blocks.0", "transformer.blocks.0"):
        resolve_offload_plan(pipe, DIT)
    # a component that holds another component's block (with no block list of its own) is refused too
    dit = ToyDiT()
    with raises_naming("ToyPipeline", "helper", "transformer.blocks.1", "one component"):
        resolve_offload_plan(ToyPipeline(transformer=dit, helper=dit.blocks[1]), DIT)


def test_exactly_one_streamable_block():
    with raises_naming("ToyPipeline", "transformer.blocks.0", "nothing to prefetch"):
        resolve_offload_plan(ToyPipeline(transformer=ToyDiT(1)), DIT)
    # resident layers leaving one block to stream are allowed (issue: "all-but-one" resident)
    cls = pipeline_class("ResidentPipeline", _offload_plan=OffloadPlan(resident_dit_paths=frozenset({"transformer"})))
    resolve_offload_plan(cls(transformer=ToyDiT(3)), layer("dit", dit={"resident_layers": 2}))
    # one DiT block plus text-encoder blocks is fine: there is something to prefetch
    resolve_offload_plan(ToyPipeline(transformer=ToyDiT(1), text_encoder=DeclaredEncoder()), BOTH)


def test_dit_selected_but_nothing_to_stream():
    with raises_naming("ToyPipeline", "transformer", "no dit component can stream", "no block list found"):
        resolve_offload_plan(ToyPipeline(transformer=PlainDiT(), vae=nn.Linear(2, 2)), DIT)
    with raises_naming("ToyPipeline", "components", "no dit component", "vae (vae)"):
        resolve_offload_plan(ToyPipeline(vae=nn.Linear(2, 2), text_encoder=DeclaredEncoder()), DIT)


def test_text_encoder_selected_but_nothing_to_stream():
    with raises_naming("ToyPipeline", "text_encoder", "no text_encoder component can stream"):
        resolve_offload_plan(ToyPipeline(transformer=ToyDiT(), text_encoder=PromptModel()), TEXT)
    # an encoder with declared block lists but no text_encoder type: the message says what is missing
    cls = pipeline_class(
        "UntypedPipeline",
        _encoder_modules=["prompt_model"],
        _offload_plan=OffloadPlan(encoder_block_attrs={"prompt_model": ("encoder.layers",)}),
    )
    hint = ("prompt_model", "encoder_component_types")
    with raises_naming("UntypedPipeline", "components", "no text_encoder component", *hint):
        resolve_offload_plan(cls(transformer=ToyDiT(), prompt_model=PromptModel()), TEXT)


def test_module_mode_selection_without_such_a_component():
    with raises_naming("ToyPipeline", "components", '"vae"', "no vae component"):
        resolve_offload_plan(ToyPipeline(transformer=ToyDiT()), {"mode": "module", "components": ["vae"]})


def test_allgather_needs_replicated_encoder_weights(tiny):
    config = layer("dit", "text_encoder", text_encoder={"weight_transfer": "allgather"})
    with raises_naming("MyPipeline", "prompt_model", "allgather", "encoder_dlo_weight_replication"):
        resolve_offload_plan(MyPipeline(transformer=tiny.get("wan")), config)
    replicated = pipeline_class(
        "ReplicatedPipeline",
        base=MyPipeline,
        _offload_plan=OffloadPlan(
            encoder_component_types={"prompt_model": "text_encoder"},
            encoder_block_attrs={"prompt_model": ("encoder.layers",)},
            encoder_dlo_weight_replication=frozenset({"prompt_model"}),
        ),
    )
    resolved = resolve_offload_plan(replicated(transformer=tiny.get("wan")), config)
    assert resolved.component("prompt_model").weight_transfer == "allgather"


def test_unknown_encoder_type():
    cls = pipeline_class(
        "TypedPipeline",
        _encoder_modules=["prompt_model"],
        _offload_plan=OffloadPlan(encoder_component_types={"prompt_model": "image_encoder"}),
    )
    with raises_naming("TypedPipeline", "prompt_model", "'image_encoder'", "allowed: 'text_encoder'"):
        resolve_offload_plan(cls(transformer=ToyDiT(), prompt_model=PromptModel()), DIT)


def test_resident_layers_need_a_resident_dit_path():
    config = layer("dit", dit={"resident_layers": 1})
    with raises_naming("ToyPipeline", "transformer", "resident_layers = 1", "resident_dit_paths"):
        resolve_offload_plan(ToyPipeline(transformer=DeclaredDiT()), config)


def test_on_demand_component_without_the_methods():
    plan = OffloadPlan(on_demand_component_paths=frozenset({"enhancer"}))
    cls = pipeline_class("OnDemandPipeline", _offload_plan=plan)
    with raises_naming("OnDemandPipeline", "enhancer", "load_to_device()", "offload_to_cpu()"):
        resolve_offload_plan(cls(transformer=ToyDiT(), enhancer=nn.Linear(2, 2)), DIT)


def test_offload_submodules_outside_a_dit():
    plan = OffloadPlan(offload_submodules={"text_encoder.encoder": "layers"})
    cls = pipeline_class("SubPipeline", _offload_plan=plan)
    with raises_naming("SubPipeline", "text_encoder.encoder", "'text_encoder'", "not a DiT"):
        resolve_offload_plan(cls(transformer=ToyDiT(), text_encoder=PromptModel()), DIT)
    cls = pipeline_class("SubPipeline", _offload_plan=OffloadPlan(offload_submodules={"context_encoder": "blocks"}))
    with raises_naming("SubPipeline", "context_encoder", "neither inside a component nor a child of a DiT"):
        resolve_offload_plan(cls(transformer=ToyDiT()), DIT)


def test_contradicting_declarations():
    cls = pipeline_class(
        "BothPipeline",
        _dit_modules=["backbone"],
        _offload_plan=OffloadPlan(encoder_block_attrs={"backbone": ("blocks",)}),
    )
    with raises_naming("BothPipeline", "backbone", "both as a DiT", "encoder"):
        resolve_offload_plan(cls(backbone=ToyDiT()), DIT)
    plan = OffloadPlan(block_attrs={"transformer": ("blocks",), "transformer.blocks.0": ("x",)})
    cls = pipeline_class("NestPipeline", _offload_plan=plan)
    with raises_naming("NestPipeline", "transformer.blocks.0", "may not nest"):
        resolve_offload_plan(cls(transformer=ToyDiT()), DIT)
    cls = pipeline_class("NotDiTPipeline", _offload_plan=OffloadPlan(resident_dit_paths=frozenset({"vae"})))
    with raises_naming("NotDiTPipeline", "vae", "resident_dit_paths", "'vae'"):
        resolve_offload_plan(cls(transformer=ToyDiT(), vae=nn.Linear(2, 2)), DIT)


def test_declared_module_lists_must_be_lists_of_paths():
    cls = pipeline_class("StringListPipeline", _dit_modules="transformer")
    with raises_naming("StringListPipeline", "_dit_modules", "list of attribute paths"):
        resolve_offload_plan(cls(transformer=ToyDiT()), DIT)


def test_objects_that_are_not_pipelines():
    with raises_naming("int", "neither a diffusers pipeline"):
        resolve_offload_plan(42, DIT)
