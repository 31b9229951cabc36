"""`OffloadPlan` and `get_offload_plan`: the model-side declaration, compatible with vllm-omni's offloader."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch.nn as nn

from layerstream.plan.offload_plan import OffloadPlan, OffloadPlanError, get_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

MAP_OF_PATHS_FIELDS = ("block_attrs", "encoder_block_attrs", "encoder_host_resident_table_attrs")
MAP_OF_STR_FIELDS = ("offload_submodules", "encoder_component_types")
SET_FIELDS = ("resident_dit_paths", "encoder_dlo_weight_replication", "on_demand_component_paths")
MAPPING_FIELDS = MAP_OF_PATHS_FIELDS + MAP_OF_STR_FIELDS + ("layerwise_resident_layers",)
TUPLE_FIELDS = ("resident_paths", "components", "phases", "legacy_selections")
ALL_FIELDS = MAPPING_FIELDS + SET_FIELDS + TUPLE_FIELDS

FULL_PLAN_KWARGS = {
    "block_attrs": {"transformer": ("blocks",), "transformer_2": ["blocks", "single_blocks"]},
    "offload_submodules": {"transformer.context_encoder": "layers"},
    "resident_dit_paths": ["transformer"],
    "encoder_component_types": {"text_encoder": "text_encoder"},
    "encoder_block_attrs": {"text_encoder": ["encoder.block"]},
    "encoder_dlo_weight_replication": {"text_encoder"},
    "on_demand_component_paths": ("prompt_enhancer",),
    "layerwise_resident_layers": {"transformer": 2},
    "resident_paths": ["transformer.pos_embed"],
    "components": ["spec"],
    "phases": ("phase",),
    "legacy_selections": ("selection",),
    "encoder_host_resident_table_attrs": {"text_encoder": ["shared"]},
}


def test_error_is_a_type_error():
    assert issubclass(OffloadPlanError, TypeError)


def test_fields_are_exactly_the_public_ones():
    assert tuple(f.name for f in dataclasses.fields(OffloadPlan)) == (
        "block_attrs",
        "offload_submodules",
        "resident_dit_paths",
        "encoder_component_types",
        "encoder_block_attrs",
        "encoder_dlo_weight_replication",
        "on_demand_component_paths",
        "layerwise_resident_layers",
        "resident_paths",
        "components",
        "phases",
        "legacy_selections",
        "encoder_host_resident_table_attrs",
    )


def test_defaults_are_empty():
    plan = OffloadPlan()
    for name in MAPPING_FIELDS:
        assert dict(getattr(plan, name)) == {}, name
    for name in SET_FIELDS:
        assert getattr(plan, name) == frozenset(), name
        assert isinstance(getattr(plan, name), frozenset), name
    for name in TUPLE_FIELDS:
        assert getattr(plan, name) == (), name
    assert plan == OffloadPlan()


def test_default_mappings_are_not_shared_mutable_state():
    a, b = OffloadPlan(), OffloadPlan()
    for name in MAPPING_FIELDS:
        with pytest.raises(TypeError):
            getattr(a, name)["x"] = ("y",)
        assert dict(getattr(b, name)) == {}


def test_every_field_is_accepted_and_normalized():
    plan = OffloadPlan(**FULL_PLAN_KWARGS)
    assert dict(plan.block_attrs) == {"transformer": ("blocks",), "transformer_2": ("blocks", "single_blocks")}
    assert all(type(v) is tuple for v in plan.block_attrs.values())
    assert dict(plan.offload_submodules) == {"transformer.context_encoder": "layers"}
    assert plan.resident_dit_paths == frozenset({"transformer"})
    assert dict(plan.encoder_component_types) == {"text_encoder": "text_encoder"}
    assert dict(plan.encoder_block_attrs) == {"text_encoder": ("encoder.block",)}
    assert type(plan.encoder_block_attrs["text_encoder"]) is tuple
    assert plan.encoder_dlo_weight_replication == frozenset({"text_encoder"})
    assert plan.on_demand_component_paths == frozenset({"prompt_enhancer"})
    assert dict(plan.layerwise_resident_layers) == {"transformer": 2}
    assert plan.resident_paths == ("transformer.pos_embed",)
    assert (plan.components, plan.phases, plan.legacy_selections) == (("spec",), ("phase",), ("selection",))
    assert dict(plan.encoder_host_resident_table_attrs) == {"text_encoder": ("shared",)}
    for name in SET_FIELDS:
        assert type(getattr(plan, name)) is frozenset, name
    assert OffloadPlan(layerwise_resident_layers=3).layerwise_resident_layers == 3  # one count for every resident DiT


@pytest.mark.parametrize("value", [["a", "b"], ("a", "b"), {"a", "b"}, frozenset({"a", "b"})])
def test_set_fields_accept_any_collection_of_str(value):
    for name in SET_FIELDS:
        assert getattr(OffloadPlan(**{name: value}), name) == frozenset({"a", "b"})


def test_plan_is_frozen():
    plan = OffloadPlan(**FULL_PLAN_KWARGS)
    for name in ALL_FIELDS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, name, getattr(OffloadPlan(), name))


@pytest.mark.parametrize("name", MAPPING_FIELDS)
def test_mapping_fields_cannot_be_mutated(name):
    plan = OffloadPlan(**FULL_PLAN_KWARGS)
    before = dict(getattr(plan, name))
    mapping = getattr(plan, name)
    key = next(iter(mapping))
    with pytest.raises(TypeError):
        mapping[key] = mapping[key]
    with pytest.raises(TypeError):
        mapping["new"] = mapping[key]
    with pytest.raises(TypeError):
        del mapping[key]
    assert not hasattr(mapping, "pop") and not hasattr(mapping, "update")
    assert dict(getattr(plan, name)) == before


def test_plan_does_not_alias_the_caller_containers():
    blocks = ["blocks"]
    block_attrs = {"transformer": blocks}
    submodules = {"transformer.context_encoder": "layers"}
    resident = ["transformer"]
    plan = OffloadPlan(block_attrs=block_attrs, offload_submodules=submodules, resident_dit_paths=resident)
    blocks.append("single_blocks")
    block_attrs["transformer_2"] = ("blocks",)
    submodules["x"] = "y"
    resident.append("transformer_2")
    assert dict(plan.block_attrs) == {"transformer": ("blocks",)}
    assert dict(plan.offload_submodules) == {"transformer.context_encoder": "layers"}
    assert plan.resident_dit_paths == frozenset({"transformer"})


def test_equal_plans_hash_equal_whatever_the_order_given():
    a = OffloadPlan(
        block_attrs={"transformer": ("blocks",), "transformer_2": ("blocks",)},
        encoder_component_types={"te": "text_encoder", "te_2": "text_encoder"},
        resident_dit_paths=["transformer", "transformer_2"],
    )
    b = OffloadPlan(
        block_attrs={"transformer_2": ["blocks"], "transformer": ["blocks"]},
        encoder_component_types={"te_2": "text_encoder", "te": "text_encoder"},
        resident_dit_paths={"transformer_2", "transformer"},
    )
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != OffloadPlan(block_attrs={"transformer": ("blocks",)})


def test_plan_survives_replace_pickle_and_deepcopy():
    plan = OffloadPlan(**FULL_PLAN_KWARGS)
    for clone in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan), dataclasses.replace(plan)):
        assert clone == plan
        with pytest.raises(TypeError):
            clone.block_attrs["x"] = ("y",)
    changed = dataclasses.replace(plan, resident_dit_paths=[])
    assert changed.resident_dit_paths == frozenset()
    assert changed.block_attrs == plan.block_attrs


# --- wrong types ------------------------------------------------------------------------------------------

BAD_VALUES = {
    "block_attrs": [None, ["blocks"], "blocks", {"transformer": "blocks"}, {"transformer": ()}, {"transformer": [1]},
                    {"transformer": ("",)}, {1: ("blocks",)}, {"": ("blocks",)}, {"transformer": None}],
    "encoder_block_attrs": [None, ("encoder.layers",), {"te": "encoder.layers"}, {"te": []}, {"te": (None,)}, {None: ("x",)}],
    "offload_submodules": [None, ["layers"], {"a": ("layers",)}, {"a": 1}, {"a": ""}, {1: "layers"}, {"": "layers"}],
    "encoder_component_types": [None, "text_encoder", {"te": None}, {"te": ""}, {2: "text_encoder"}, {"te": ["text_encoder"]}],
    "resident_dit_paths": [None, "transformer", {"transformer": True}, [1], [""], 5, ["transformer", None]],
    "encoder_dlo_weight_replication": [None, "text_encoder", {"te": "te"}, [b"te"], [""]],
    "on_demand_component_paths": [None, "prompt_enhancer", (i for i in ["a"]), [3.0], [""]],
    "layerwise_resident_layers": [None, -1, True, 2.0, "2", {"transformer": -1}, {"transformer": True}, {"": 1}, ["transformer"]],
    "resident_paths": [None, "transformer", [1], [""], {"transformer": 1}],
    "components": [None, "spec", {"a": 1}, 3],
    "phases": [None, "denoise", {"a": 1}],
    "legacy_selections": [None, "layerwise", {"a": 1}],
    "encoder_host_resident_table_attrs": [None, {"te": "shared"}, {"te": ()}, ("shared",)],
}
BAD_CASES = [(name, value) for name, values in BAD_VALUES.items() for value in values]


def test_every_field_has_bad_cases():
    assert set(BAD_VALUES) == set(ALL_FIELDS)


@pytest.mark.parametrize(("name", "value"), BAD_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CASES)])
def test_wrong_type_names_the_class_and_field(name, value):
    with pytest.raises(OffloadPlanError) as info:
        OffloadPlan(**{name: value})
    message = str(info.value)
    assert isinstance(info.value, TypeError)
    assert f"OffloadPlan.{name} = " in message, message
    assert "expected" in message, message


def test_a_bare_string_block_list_is_not_split_into_characters():
    with pytest.raises(OffloadPlanError, match=r"OffloadPlan\.block_attrs = .*\('blocks',\)"):
        OffloadPlan(block_attrs={"transformer": "blocks"})


def test_a_bare_string_set_field_is_not_split_into_characters():
    with pytest.raises(OffloadPlanError, match=r"OffloadPlan\.resident_dit_paths"):
        OffloadPlan(resident_dit_paths="transformer")


def test_positional_construction_is_refused_with_a_clear_error():
    # vllm-omni's versions order their fields differently (its current one starts with `components`), so a
    # positional plan has no one meaning: it is refused, naming the keyword form.
    with pytest.raises(OffloadPlanError, match=r"keyword arguments only \(block_attrs, .*1 positional"):
        OffloadPlan({"transformer": ("blocks",)})


# --- get_offload_plan -------------------------------------------------------------------------------------


class MyPipeline(nn.Module):
    _encoder_modules = ["prompt_model"]
    _offload_plan = OffloadPlan(
        encoder_component_types={"prompt_model": "text_encoder"},
        encoder_block_attrs={"prompt_model": ("encoder.layers",)},
    )


def test_vllm_omni_example_plan():
    pipeline = MyPipeline()
    plan = get_offload_plan(pipeline)
    assert plan is MyPipeline._offload_plan
    assert dict(plan.encoder_component_types) == {"prompt_model": "text_encoder"}
    assert dict(plan.encoder_block_attrs) == {"prompt_model": ("encoder.layers",)}
    assert dict(plan.block_attrs) == {}
    assert plan.resident_dit_paths == frozenset()
    assert MyPipeline._encoder_modules == ["prompt_model"]


def test_plan_is_inherited_by_subclasses():
    class Derived(MyPipeline):
        pass

    assert get_offload_plan(Derived()) is MyPipeline._offload_plan


def test_no_plan_gives_none():
    class Plain(nn.Module):
        pass

    class NotAModule:
        pass

    assert get_offload_plan(Plain()) is None
    assert get_offload_plan(NotAModule()) is None
    assert get_offload_plan(object()) is None


def test_a_plan_of_none_gives_none():
    class Opted(nn.Module):
        _offload_plan = None

    assert get_offload_plan(Opted()) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"block_attrs": {"transformer": ("blocks",)}},
        "OffloadPlan()",
        ["blocks"],
        OffloadPlan,  # the class itself, not an instance
        0,
    ],
)
def test_a_plan_of_the_wrong_type_is_an_error(bad):
    pipeline_cls = type("BadPipeline", (nn.Module,), {"_offload_plan": bad})
    with pytest.raises(OffloadPlanError) as info:
        get_offload_plan(pipeline_cls())
    message = str(info.value)
    assert "BadPipeline._offload_plan" in message, message
    assert type(bad).__name__ in message, message
    assert "OffloadPlan" in message.split(";", 1)[1], message


def test_an_instance_attribute_wins_over_the_class_attribute():
    """As vllm-omni reads it: a plan set on the instance is that pipeline's plan."""

    class Both:
        _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})

    pipeline = Both()
    mine = OffloadPlan(block_attrs={"transformer": ("other",)})
    pipeline._offload_plan = mine
    assert get_offload_plan(pipeline) is mine
    assert get_offload_plan(Both()) is Both._offload_plan


def test_the_pipeline_class_itself_may_be_given():
    assert get_offload_plan(MyPipeline) is MyPipeline._offload_plan
    bad_cls = type("BadPipeline", (nn.Module,), {"_offload_plan": {"block_attrs": {}}})
    with pytest.raises(OffloadPlanError, match=r"^BadPipeline\._offload_plan is dict"):
        get_offload_plan(bad_cls)
