"""Behaviours of vllm-omni's offloader that plans and models written for it rely on: `offload_submodules` keyed by
a DiT's child name, resident layers beyond the stack, the singular class attribute, the instance's plan."""

from __future__ import annotations

import pytest
import torch
from plan_toys import ContextDiT, pipeline_class
from plan_toys import ToyDiT as PlainToyDiT
from torch import nn

from layerstream import OffloadPlan, enable_offload
from layerstream.offload import plan_placement
from layerstream.plan.resolved import OffloadPlanResolutionError
from layerstream.plan.resolver import resolve_offload_plan
from tests.runtime.runtime_toys import ToyBlock, make_my_pipeline, run, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def test_resident_layers_beyond_the_stack_keep_every_block_resident():
    pipe = make_my_pipeline()
    pipe._offload_plan = OffloadPlan(resident_dit_paths=frozenset({"transformer"}))
    inputs = toy_inputs()
    expected = run(pipe, inputs)
    config = {**DIT, "layer_options": {"dit": {"resident_layers": 10}}}
    placement = plan_placement(pipe, resolve_offload_plan(pipe, config))
    choice = placement.residency["transformer"]
    assert len(choice.resident_block_paths) == choice.num_blocks == len(pipe.transformer.blocks)
    assert "keeps every one of the 4 blocks resident" in choice.reason
    handle = enable_offload(pipe, config, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    assert "4/4 blocks resident" in handle.stats().residency["transformer"]
    handle.disable()
    assert torch.equal(run(pipe, inputs), expected)


class SingularDiT(nn.Module):
    _layerwise_offload_blocks_attr = "layers"  # the deprecated singular spelling: one name, a string

    def __init__(self, dim: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_singular_class_attribute_declares_the_block_list():
    model = SingularDiT()
    plan = resolve_offload_plan(model, DIT)
    (comp,) = plan.streamed
    assert comp.source == "class_attribute"
    assert [p for s in comp.stacks for p in s.block_paths] == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    handle = enable_offload(model, DIT, device="cpu")
    assert torch.equal(run(model, (x,)), expected)
    handle.disable()


def test_the_instances_plan_wins_over_its_classs():
    pipe = make_my_pipeline()
    assert resolve_offload_plan(pipe, {"mode": "layer", "components": ["text_encoder"]}).streamed  # the class's plan
    pipe._offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})  # this instance: no encoder blocks
    plan = resolve_offload_plan(pipe, DIT)
    assert [c.path for c in plan.streamed] == ["transformer"] and plan.component("transformer").source == "plan"
    encoder = plan.component("prompt_model")
    assert encoder.action != "stream"


def _context_pipeline(submodules: dict[str, str], **components):
    cls = pipeline_class("ContextPipeline", _offload_plan=OffloadPlan(offload_submodules=submodules))
    return cls(**components)


def test_offload_submodules_keyed_by_the_dits_child_name_as_vllm_omni_keys_them():
    by_name = resolve_offload_plan(_context_pipeline({"context_encoder": "blocks"}, transformer=ContextDiT()), DIT)
    by_path = resolve_offload_plan(_context_pipeline({"transformer.context_encoder": "blocks"}, transformer=ContextDiT()), DIT)
    assert by_name.component("transformer").stacks == by_path.component("transformer").stacks
    (_, sub) = by_name.component("transformer").stacks
    assert sub.block_paths == ("transformer.context_encoder.blocks.0", "transformer.context_encoder.blocks.1")


def test_a_child_name_found_under_two_dits_applies_to_both_and_under_none_is_an_error():
    pipe = _context_pipeline({"context_encoder": "blocks"}, transformer=ContextDiT(), transformer_2=ContextDiT())
    plan = resolve_offload_plan(pipe, DIT)
    for dit in ("transformer", "transformer_2"):
        assert plan.component(dit).stacks[-1].block_paths[0] == f"{dit}.context_encoder.blocks.0"
    with pytest.raises(OffloadPlanResolutionError, match="context_encoder.*neither inside a component nor a child of a DiT"):
        resolve_offload_plan(_context_pipeline({"context_encoder": "blocks"}, transformer=PlainToyDiT()), DIT)
