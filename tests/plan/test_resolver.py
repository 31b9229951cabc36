"""`resolve_offload_plan`: precedence of block sources, inputs, categories, actions, options and purity."""

from __future__ import annotations

import json
from itertools import chain

import pytest
import torch
from plan_toys import (
    BOTH,
    DIT,
    TEXT,
    Block,
    ContextDiT,
    DeclaredDiT,
    DeclaredEncoder,
    MyPipeline,
    OnDemand,
    OtherBlock,
    PromptModel,
    ToyDiT,
    ToyPipeline,
    layer,
    pipeline_class,
    raises_naming,
    stack_names,
)
from torch import nn

from layerstream.config.offload_config import OffloadConfigError, parse_offload_config
from layerstream.plan.offload_plan import OffloadPlan, OffloadPlanError
from layerstream.plan.resolved import OffloadPlanResolutionError, lookup
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


# --- precedence ------------------------------------------------------------------------------------------


def test_plan_block_attrs_come_first(tiny):
    from diffusers import FluxPipeline

    # the built-in Flux plan streams both lists; the pipeline's own plan wins and streams only one
    plan = OffloadPlan(block_attrs={"transformer": ("single_transformer_blocks",)})
    cls = pipeline_class("MyFlux", base=FluxPipeline, _offload_plan=plan)
    unused = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    pipe = cls(**dict.fromkeys(unused), transformer=tiny.get("flux"))
    comp = resolve_offload_plan(pipe, DIT).component("transformer")
    assert (comp.source, comp.action) == ("plan", "stream")
    assert stack_names(comp) == ["transformer.single_transformer_blocks"]


def test_builtin_plan_comes_second(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")
    comp = resolve_offload_plan(pipe, DIT).component("transformer")
    assert comp.source == "builtin"
    assert stack_names(comp) == ["transformer.blocks"]


def test_class_attribute_comes_before_automatic_discovery():
    resolved = resolve_offload_plan(ToyPipeline(transformer=DeclaredDiT()), DIT)
    comp = resolved.component("transformer")
    assert comp.source == "class_attribute"
    assert stack_names(comp) == ["transformer.blocks"]  # auto would also have taken extra_blocks


def test_automatic_discovery_finds_lists_of_the_named_block_class():
    resolved = resolve_offload_plan(ToyPipeline(transformer=ToyDiT(3)), DIT)
    comp = resolved.component("transformer")
    assert (comp.source, comp.category, comp.action) == ("auto", "dit", "stream")
    assert comp.stacks[0].block_paths == ("transformer.blocks.0", "transformer.blocks.1", "transformer.blocks.2")


def test_automatic_discovery_matches_subclasses_and_skips_mixed_lists():
    dit = ToyDiT()
    dit.blocks.append(OtherBlock())  # a subclass of Block: still a Block
    dit.mixed = nn.ModuleList([Block(), nn.Linear(4, 4)])  # not every item is a block: not a block list
    comp = resolve_offload_plan(ToyPipeline(transformer=dit), DIT).component("transformer")
    assert stack_names(comp) == ["transformer.blocks"]
    assert comp.num_blocks == 3


def test_automatic_discovery_on_a_custom_diffusers_pipeline(tiny):
    from diffusers import DiffusionPipeline

    class MyVideoPipeline(DiffusionPipeline):  # not in the built-in registry
        def __init__(self, transformer, text_encoder, vae=None):
            super().__init__()
            self.register_modules(transformer=transformer, text_encoder=text_encoder, vae=vae)

    pipe = MyVideoPipeline(transformer=tiny.get("wan"), text_encoder=tiny.get("t5"))
    resolved = resolve_offload_plan(pipe, BOTH)
    assert resolved.pipeline_class == "MyVideoPipeline"
    assert [c.path for c in resolved.components] == ["transformer", "text_encoder"]  # vae is None: skipped
    dit, text = resolved.component("transformer"), resolved.component("text_encoder")
    assert (dit.source, stack_names(dit)) == ("auto", ["transformer.blocks"])
    assert (text.source, stack_names(text)) == ("auto", ["text_encoder.encoder.block"])  # T5's _no_split_modules
    assert {dit.action, text.action} == {"stream"}


def test_automatic_discovery_on_an_nn_module_pipeline_holding_a_diffusers_transformer(tiny):
    resolved = resolve_offload_plan(ToyPipeline(transformer=tiny.get("wan"), vae=nn.Conv2d(1, 1, 1)), DIT)
    assert resolved.component("transformer").source == "auto"
    assert resolved.component("vae").action == "resident"


def test_text_encoder_precedence(tiny):
    from diffusers import WanPipeline

    # plan beats builtin
    plan = OffloadPlan(encoder_block_attrs={"text_encoder": ("encoder.block",)})
    cls = pipeline_class("MyWan", base=WanPipeline, _offload_plan=plan)
    pipe = cls(tokenizer=None, text_encoder=tiny.get("umt5"), vae=None, scheduler=None, transformer=tiny.get("wan"))
    assert resolve_offload_plan(pipe, TEXT).component("text_encoder").source == "plan"
    # builtin
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")
    assert resolve_offload_plan(pipe, TEXT).component("text_encoder").source == "builtin"
    # class attribute, then auto
    resolved = resolve_offload_plan(ToyPipeline(transformer=ToyDiT(), text_encoder=DeclaredEncoder()), TEXT)
    assert resolved.component("text_encoder").source == "class_attribute"
    assert stack_names(resolved.component("text_encoder")) == ["text_encoder.encoder.layers"]
    resolved = resolve_offload_plan(ToyPipeline(transformer=ToyDiT(), text_encoder=tiny.get("t5")), TEXT)
    assert resolved.component("text_encoder").source == "auto"


def test_components_without_block_lists_have_source_none(tiny):
    pipe = ToyPipeline(transformer=ToyDiT(), vae=nn.Linear(2, 2), text_encoder=PromptModel())
    resolved = resolve_offload_plan(pipe, DIT)
    assert resolved.component("vae").source == "none"
    assert resolved.component("text_encoder").source == "none"  # no plan, no class attribute, nothing named
    assert resolved.component("text_encoder").stacks == ()


# --- inputs: bare models, the vllm-omni example, configs --------------------------------------------------


def test_bare_diffusers_transformer(tiny):
    model = tiny.get("wan")
    resolved = resolve_offload_plan(model, DIT)
    assert resolved.pipeline_class == "WanTransformer3DModel"
    (comp,) = resolved.components
    assert (comp.path, comp.display_path, comp.category) == ("", "<model>", "dit")
    assert (comp.source, comp.action) == ("auto", "stream")
    assert comp.stacks[0].block_paths == ("blocks.0", "blocks.1")
    assert all(type(lookup(model, p)).__name__ == "WanTransformerBlock" for p in comp.stacks[0].block_paths)
    assert comp.resident_allowed  # discovered automatically


def test_bare_model_with_class_attribute():
    (comp,) = resolve_offload_plan(DeclaredDiT(), DIT).components
    assert (comp.path, comp.source) == ("", "class_attribute")


def test_vllm_omni_style_pipeline(tiny):
    pipe = MyPipeline(transformer=tiny.get("wan"))
    resolved = resolve_offload_plan(pipe, BOTH)
    prompt, dit = resolved.component("prompt_model"), resolved.component("transformer")
    assert (prompt.category, prompt.source, prompt.action) == ("text_encoder", "plan", "stream")
    assert prompt.stacks[0].owner_path == "prompt_model"
    assert prompt.stacks[0].attr_path == "encoder.layers"
    assert prompt.stacks[0].block_paths == ("prompt_model.encoder.layers.0", "prompt_model.encoder.layers.1")
    assert not prompt.replicated  # not in encoder_dlo_weight_replication
    assert (dit.category, dit.source, dit.action) == ("dit", "auto", "stream")
    assert dit.replicated


def test_config_may_be_a_dict_json_text_or_an_offload_config():
    pipe = ToyPipeline(transformer=ToyDiT())
    results = {resolve_offload_plan(pipe, c) for c in (DIT, json.dumps(DIT), parse_offload_config(DIT))}
    assert len(results) == 1


def test_bad_config_is_rejected_by_the_config_parser():
    with pytest.raises(OffloadConfigError, match="components"):
        resolve_offload_plan(ToyPipeline(transformer=ToyDiT()), {"mode": "layer", "components": ["vae"]})


def test_a_plan_that_is_not_an_offload_plan_is_a_type_error():
    cls = pipeline_class("BadPlanPipeline", _offload_plan={"block_attrs": {}})
    with pytest.raises(OffloadPlanError, match="BadPlanPipeline"):
        resolve_offload_plan(cls(transformer=ToyDiT()), DIT)


# --- categories --------------------------------------------------------------------------------------------


def _children_named_like_roles() -> dict[str, nn.Module]:
    return dict(
        backbone=ToyDiT(),
        transformer_2=ToyDiT(),
        prompt_model=PromptModel(),
        caption_model=PromptModel(),
        text_encoder_2=PromptModel(),
        umt5_text_encoder=PromptModel(),
        decoder=nn.Linear(2, 2),
        vae_2=nn.Linear(2, 2),
        image_encoder=nn.Linear(2, 2),
        scheduler_net=nn.Linear(2, 2),
    )


def test_categories_follow_the_declared_role_lists_alone():
    """A pipeline that lists some of its roles is categorized by those lists: undeclared children are not a DiT
    or a text encoder because of their names; the role it does not list (here the VAE) keeps the name rule."""
    cls = pipeline_class(
        "SomeRolesPipeline",
        _dit_modules=["backbone"],
        _encoder_modules=["prompt_model", "caption_model"],
        _offload_plan=OffloadPlan(encoder_component_types={"caption_model": "text_encoder"}),
    )
    resolved = resolve_offload_plan(cls(**_children_named_like_roles()), DIT)
    assert {c.path: c.category for c in resolved.components} == {
        "backbone": "dit",  # _dit_modules
        "transformer_2": "other",  # named like a DiT, but _dit_modules does not list it
        "prompt_model": "encoder",  # _encoder_modules, not typed
        "caption_model": "text_encoder",  # encoder_component_types
        "text_encoder_2": "other",  # named like a text encoder, but _encoder_modules does not list it
        "umt5_text_encoder": "other",
        "decoder": "other",  # no _vae_modules: the name rule, and "decoder" is no VAE's name
        "vae_2": "vae",
        "image_encoder": "image_encoder",
        "scheduler_net": "other",
    }
    assert {c.path for c in resolved.streamed} == {"backbone"}
    assert resolved.untouched == ()


def test_a_pipeline_that_declares_its_roles_leaves_undeclared_children_untouched():
    """All three role lists (vllm-omni's SupportsComponentDiscovery): the lists are the whole picture; a child
    none of the pipeline's declarations names is no component at all, and `plan` lists it as untouched."""
    cls = pipeline_class(
        "RolesPipeline",
        _dit_modules=["backbone"],
        _encoder_modules=["prompt_model"],
        _vae_modules=["decoder"],
        _offload_plan=OffloadPlan(encoder_component_types={"caption_model": "text_encoder"}),
    )
    resolved = resolve_offload_plan(cls(**_children_named_like_roles()), DIT)
    assert {c.path: c.category for c in resolved.components} == {
        "backbone": "dit",  # _dit_modules
        "prompt_model": "encoder",  # _encoder_modules, not typed
        "caption_model": "text_encoder",  # declared by the pipeline's own _offload_plan
        "decoder": "vae",  # _vae_modules
    }
    untouched = ["transformer_2", "text_encoder_2", "umt5_text_encoder", "vae_2", "image_encoder", "scheduler_net"]
    assert [u.path for u in resolved.untouched] == untouched
    assert [u["path"] for u in resolved.to_dict()["untouched"]] == untouched


def test_without_role_lists_the_name_rule_categorizes():
    cls = pipeline_class("NamedPipeline")
    pipe = cls(
        transformer_2=ToyDiT(),
        text_encoder_2=PromptModel(),
        umt5_text_encoder=PromptModel(),
        vae_2=nn.Linear(2, 2),
        image_encoder=nn.Linear(2, 2),
        scheduler_net=nn.Linear(2, 2),
    )
    assert {c.path: c.category for c in resolve_offload_plan(pipe, DIT).components} == {
        "transformer_2": "dit",  # name starts with transformer
        "text_encoder_2": "text_encoder",  # name starts with text_encoder
        "umt5_text_encoder": "text_encoder",  # name ends with text_encoder
        "vae_2": "vae",
        "image_encoder": "image_encoder",
        "scheduler_net": "other",
    }


def test_dotted_declared_paths_stand_in_for_the_module_holding_them():
    holder = nn.Module()
    holder.dit = ToyDiT()
    holder.extra = nn.Linear(2, 2)
    cls = pipeline_class("NestedPipeline", _offload_plan=OffloadPlan(block_attrs={"model.dit": ("blocks",)}))
    resolved = resolve_offload_plan(cls(model=holder, vae=nn.Linear(2, 2)), DIT)
    assert [c.path for c in resolved.components] == ["model.dit", "vae"]
    assert resolved.component("model.dit").stacks[0].block_paths[0] == "model.dit.blocks.0"


def test_none_and_non_module_components_are_skipped(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")  # tokenizer, scheduler, vae: None
    assert [c.path for c in resolve_offload_plan(pipe, DIT).components] == ["text_encoder", "transformer"]


# --- offload_submodules and on-demand components ----------------------------------------------------------


def test_offload_submodules_become_own_chain_stacks_of_their_dit():
    cls = pipeline_class(
        "ContextPipeline", _offload_plan=OffloadPlan(offload_submodules={"transformer.context_encoder": "blocks"})
    )
    comp = resolve_offload_plan(cls(transformer=ContextDiT()), DIT).component("transformer")
    assert comp.source == "auto"
    main, sub = comp.stacks  # auto discovery does not search inside the submodule: no block is claimed twice
    assert (main.qualified_name, main.own_chain) == ("transformer.blocks", False)
    assert (sub.owner_path, sub.attr_path, sub.own_chain) == ("transformer.context_encoder", "blocks", True)
    assert sub.block_paths == ("transformer.context_encoder.blocks.0", "transformer.context_encoder.blocks.1")


def test_on_demand_components():
    plan = OffloadPlan(on_demand_component_paths=frozenset({"prompt_enhancer"}))
    cls = pipeline_class("OnDemandPipeline", _offload_plan=plan)
    pipe = cls(transformer=ToyDiT(), prompt_enhancer=OnDemand())
    for config in (DIT, {"mode": "module", "components": ["dit"]}):  # not selected: stays resident
        comp = resolve_offload_plan(pipe, config).component("prompt_enhancer")
        assert (comp.action, comp.on_demand) == ("resident", False)
    assert "offload_to_cpu() is not called" in resolve_offload_plan(pipe, DIT).component("prompt_enhancer").reason


# --- actions and options -----------------------------------------------------------------------------------


def test_layer_mode_streams_only_the_selected_categories(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", transformer_2="wan_2", text_encoder="umt5", vae="wan_vae")
    actions = {c.path: c.action for c in resolve_offload_plan(pipe, TEXT).components}
    assert actions == {
        "vae": "resident",
        "text_encoder": "stream",
        "transformer": "resident",
        "transformer_2": "resident",
    }
    actions = {c.path: c.action for c in resolve_offload_plan(pipe, BOTH).components}
    assert actions == {"vae": "resident", "text_encoder": "stream", "transformer": "stream", "transformer_2": "stream"}


def test_module_mode_swaps_whole_components(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5", vae="wan_vae")
    resolved = resolve_offload_plan(pipe, {"mode": "module", "components": ["dit", "vae"]})
    actions = {c.path: c.action for c in resolved.components}
    assert actions == {"vae": "swap", "text_encoder": "resident", "transformer": "swap"}
    assert resolved.component("vae").source == "none"


def test_stream_options_come_from_the_config_per_category(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", transformer_2="wan_2", text_encoder="umt5", vae="wan_vae")
    config = layer(
        "dit",
        "text_encoder",
        dit={"weight_transfer": "allgather", "prefetch_depth": 2, "resident_layers": 1},
        text_encoder={"weight_transfer": "allgather", "prefetch_depth": 3},
    )
    resolved = resolve_offload_plan(pipe, config)
    for path in ("transformer", "transformer_2"):
        comp = resolved.component(path)
        assert (comp.weight_transfer, comp.prefetch_depth, comp.resident_layers) == ("allgather", 2, 1)
        assert comp.resident_allowed and comp.replicated
    text = resolved.component("text_encoder")
    assert (text.weight_transfer, text.prefetch_depth, text.resident_layers) == ("allgather", 3, 0)
    assert text.replicated  # built-in encoders are loaded whole on every rank
    vae = resolved.component("vae")
    assert (vae.weight_transfer, vae.prefetch_depth, vae.resident_layers) == ("rank-local", 1, 0)
    assert not vae.resident_allowed


def test_resident_layers_auto_and_all_blocks_are_accepted(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")
    for resident_layers in ("auto", 2):
        resolved = resolve_offload_plan(pipe, layer("dit", dit={"resident_layers": resident_layers}))
        assert resolved.component("transformer").resident_layers == resident_layers


def test_resident_dit_paths_allow_resident_layers_for_declared_dits():
    cls = pipeline_class("ResidentPipeline", _offload_plan=OffloadPlan(resident_dit_paths=frozenset({"transformer"})))
    config = layer("dit", dit={"resident_layers": 1})
    comp = resolve_offload_plan(cls(transformer=DeclaredDiT(3)), config).component("transformer")
    assert (comp.source, comp.resident_allowed, comp.resident_layers) == ("class_attribute", True, 1)


def test_bytes_are_numel_times_element_size_and_work_on_meta_tensors():
    dit = ToyDiT().to(torch.float16)
    comp = resolve_offload_plan(ToyPipeline(transformer=dit), DIT).component("transformer")
    assert comp.total_bytes == sum(t.numel() * 2 for t in chain(dit.parameters(), dit.buffers()))
    assert comp.stacks[0].block_bytes == ((4 * 4 + 4) * 2,) * 2
    with torch.device("meta"):
        meta = ToyDiT().to(torch.float16)
    meta_comp = resolve_offload_plan(ToyPipeline(transformer=meta), DIT).component("transformer")
    assert (meta_comp.total_bytes, meta_comp.stacks) == (comp.total_bytes, comp.stacks)


def test_tied_weights_are_counted_once():
    dit = ToyDiT()
    dit.blocks[1].proj.weight = dit.blocks[0].proj.weight  # tied across blocks, yet not the same module
    dit.head = nn.Linear(4, 4)
    dit.head.weight = dit.embed.weight
    comp = resolve_offload_plan(ToyPipeline(transformer=dit), DIT).component("transformer")
    assert comp.total_bytes == sum(t.numel() * 4 for t in dit.parameters())  # parameters() yields a tied one once


# --- purity ----------------------------------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _snapshot(pipeline) -> dict:
    """Everything resolving could conceivably change: tensors, hooks, attributes, module trees."""
    if isinstance(pipeline, nn.Module):
        roots = {"": pipeline}
    else:
        roots = {n: m for n, m in vars(pipeline).items() if isinstance(m, nn.Module)}
    state: dict = {"pipeline": sorted(vars(pipeline)), "globals": _global_hooks()}
    for root_name, root in roots.items():
        for name, module in root.named_modules(remove_duplicate=False):
            state[f"{root_name}:{name}"] = (
                id(module),
                module.training,
                sorted(vars(module)),
                tuple(module._modules.items()),
                {h: tuple(getattr(module, h, {}).items()) for h in _HOOK_DICTS},
            )
        tensors = chain(root.named_parameters(remove_duplicate=False), root.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            state[f"{root_name}:{name}#tensor"] = (
                id(t),
                t.data_ptr(),
                t.device,
                t.dtype,
                tuple(t.shape),
                t.requires_grad,
                t._version,
            )
    return state


def _global_hooks() -> tuple:
    from torch.nn.modules import module as torch_module

    names = [n for n in dir(torch_module) if n.startswith("_global_") and n.endswith("hooks")]
    return tuple(len(getattr(torch_module, n)) for n in names)


@pytest.mark.parametrize(
    "config",
    [
        DIT,
        BOTH,
        layer("dit", dit={"resident_layers": 1}),
        {"mode": "module", "components": ["dit", "text_encoder", "vae"]},
    ],
)
def test_resolving_changes_nothing_on_a_diffusers_pipeline(tiny, config):
    transformer = tiny.fresh("wan")
    transformer.blocks[0].register_forward_pre_hook(lambda *a: None)  # existing hooks stay as they are
    components = {"transformer_2": "wan_2", "text_encoder": "umt5", "vae": "wan_vae"}
    pipe = tiny.pipeline("WanPipeline", transformer=transformer, **components)
    before = _snapshot(pipe)
    first = resolve_offload_plan(pipe, config)
    assert _snapshot(pipe) == before
    assert resolve_offload_plan(pipe, config) == first  # and it is deterministic


def test_resolving_changes_nothing_on_module_pipelines_even_when_it_fails(tiny):
    pipe = MyPipeline(transformer=tiny.get("wan"))
    before = _snapshot(pipe)
    resolve_offload_plan(pipe, BOTH)
    with pytest.raises(OffloadPlanResolutionError):
        resolve_offload_plan(pipe, layer("text_encoder", text_encoder={"weight_transfer": "allgather"}))
    assert _snapshot(pipe) == before
    model = tiny.get("flux")
    before = _snapshot(model)
    resolve_offload_plan(model, DIT)
    assert _snapshot(model) == before


def test_properties_are_never_read():
    class WatchedDiT(ToyDiT):
        @property
        def blocks_view(self):
            raise AssertionError("the resolver read a property")

    cls = pipeline_class("PropertyPipeline", _offload_plan=OffloadPlan(block_attrs={"transformer": ("blocks_view",)}))
    with raises_naming("PropertyPipeline", "transformer.blocks_view", "property"):
        resolve_offload_plan(cls(transformer=WatchedDiT()), DIT)
