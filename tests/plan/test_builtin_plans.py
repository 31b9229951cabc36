"""Built-in plans: every registered diffusers pipeline class, built with tiny components, resolves to the
block lists read from the installed diffusers/transformers sources."""

from __future__ import annotations

import pytest
from torch import nn

from layerstream.plan.builtin_plans import (
    BUILTIN_FAMILIES,
    TEXT_ENCODER_BLOCK_ATTRS,
    builtin_family_for,
    builtin_plan_for,
)
from layerstream.plan.discovery import find_block_lists
from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolved import lookup
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}

# tiny model kind -> {block-list attribute: class of its blocks}, written from the library sources (not from
# builtin_plans.py), so a wrong registered path fails here
EXPECTED_LISTS = {
    "wan": {"blocks": "WanTransformerBlock"},
    "wan_2": {"blocks": "WanTransformerBlock"},
    "wan_vace": {"vace_blocks": "WanVACETransformerBlock", "blocks": "WanTransformerBlock"},  # vace runs first
    "wan_animate": {"blocks": "WanTransformerBlock"},
    "flux": {"transformer_blocks": "FluxTransformerBlock", "single_transformer_blocks": "FluxSingleTransformerBlock"},
    "flux2": {
        "transformer_blocks": "Flux2TransformerBlock",
        "single_transformer_blocks": "Flux2SingleTransformerBlock",
    },
    "qwenimage": {"transformer_blocks": "QwenImageTransformerBlock"},
    "hunyuan": {
        "transformer_blocks": "HunyuanVideoTransformerBlock",
        "single_transformer_blocks": "HunyuanVideoSingleTransformerBlock",
    },
    "hunyuan_token_replace": {
        "transformer_blocks": "HunyuanVideoTokenReplaceTransformerBlock",
        "single_transformer_blocks": "HunyuanVideoTokenReplaceSingleTransformerBlock",
    },
    "framepack": {
        "transformer_blocks": "HunyuanVideoTransformerBlock",
        "single_transformer_blocks": "HunyuanVideoSingleTransformerBlock",
    },
    "ltx": {"transformer_blocks": "LTXVideoTransformerBlock"},
    "sd3": {"transformer_blocks": "JointTransformerBlock"},
    "cogvideox": {"transformer_blocks": "CogVideoXBlock"},
    # HiDream wraps each block: the wrappers are what the transformer calls
    "hidream": {"double_stream_blocks": "HiDreamBlock", "single_stream_blocks": "HiDreamBlock"},
    "umt5": {"encoder.block": "UMT5Block"},
    "t5": {"encoder.block": "T5Block"},
    "clip": {"encoder.layers": "CLIPEncoderLayer"},
    "clip_projection": {"text_model.encoder.layers": "CLIPEncoderLayer"},
    "clip_projection_2": {"text_model.encoder.layers": "CLIPEncoderLayer"},
    "llama": {"layers": "LlamaDecoderLayer"},
    "llama_causal": {"model.layers": "LlamaDecoderLayer"},
    "llava": {"model.language_model.layers": "LlamaDecoderLayer"},
    "mistral3": {"model.language_model.layers": "MistralDecoderLayer"},
    "qwen3": {"model.layers": "Qwen3DecoderLayer"},
    "qwen25_vl": {"model.language_model.layers": "Qwen2_5_VLDecoderLayer"},
}

_WAN = {"transformer": "wan", "text_encoder": "umt5"}
_WAN_22 = {**_WAN, "transformer_2": "wan_2"}
_FLUX = {"transformer": "flux", "text_encoder": "clip", "text_encoder_2": "t5"}
_KLEIN = {"transformer": "flux2", "text_encoder": "qwen3"}
_QWEN = {"transformer": "qwenimage", "text_encoder": "qwen25_vl"}
_HUNYUAN = {"transformer": "hunyuan", "text_encoder": "llama", "text_encoder_2": "clip"}
_LTX = {"transformer": "ltx", "text_encoder": "t5"}
_SD3 = {
    "transformer": "sd3",
    "text_encoder": "clip_projection",
    "text_encoder_2": "clip_projection_2",
    "text_encoder_3": "t5",
}
_COG = {"transformer": "cogvideox", "text_encoder": "t5"}
_HIDREAM = {
    "transformer": "hidream",
    "text_encoder": "clip_projection",
    "text_encoder_2": "clip_projection_2",
    "text_encoder_3": "t5",
    "text_encoder_4": "llama_causal",
}

# pipeline class -> component -> tiny model kind
CASES = {
    "WanPipeline": _WAN_22,
    "WanImageToVideoPipeline": _WAN_22,
    "WanVideoToVideoPipeline": _WAN,
    "WanVACEPipeline": {"transformer": "wan_vace", "text_encoder": "umt5"},
    "WanAnimatePipeline": {"transformer": "wan_animate", "text_encoder": "umt5"},
    "FluxPipeline": _FLUX,
    "FluxImg2ImgPipeline": _FLUX,
    "FluxInpaintPipeline": _FLUX,
    "FluxFillPipeline": _FLUX,
    "FluxKontextPipeline": _FLUX,
    "FluxKontextInpaintPipeline": _FLUX,
    "FluxControlPipeline": _FLUX,
    "FluxControlImg2ImgPipeline": _FLUX,
    "FluxControlInpaintPipeline": _FLUX,
    "Flux2Pipeline": {"transformer": "flux2", "text_encoder": "mistral3"},
    "Flux2KleinPipeline": _KLEIN,
    "Flux2KleinInpaintPipeline": _KLEIN,
    "Flux2KleinKVPipeline": _KLEIN,
    "QwenImagePipeline": _QWEN,
    "QwenImageImg2ImgPipeline": _QWEN,
    "QwenImageInpaintPipeline": _QWEN,
    "QwenImageEditPipeline": _QWEN,
    "QwenImageEditInpaintPipeline": _QWEN,
    "QwenImageEditPlusPipeline": _QWEN,
    "QwenImageLayeredPipeline": _QWEN,
    "HunyuanVideoPipeline": _HUNYUAN,
    "HunyuanVideoImageToVideoPipeline": {**_HUNYUAN, "transformer": "hunyuan_token_replace", "text_encoder": "llava"},
    "HunyuanSkyreelsImageToVideoPipeline": _HUNYUAN,
    "HunyuanVideoFramepackPipeline": {**_HUNYUAN, "transformer": "framepack"},
    "LTXPipeline": _LTX,
    "LTXImageToVideoPipeline": _LTX,
    "LTXConditionPipeline": _LTX,
    "LTXI2VLongMultiPromptPipeline": _LTX,
    "StableDiffusion3Pipeline": _SD3,
    "StableDiffusion3Img2ImgPipeline": _SD3,
    "StableDiffusion3InpaintPipeline": _SD3,
    "CogVideoXPipeline": _COG,
    "CogVideoXImageToVideoPipeline": _COG,
    "CogVideoXVideoToVideoPipeline": _COG,
    "CogVideoXFunControlPipeline": _COG,
    "HiDreamImagePipeline": _HIDREAM,
}


@pytest.mark.parametrize("class_name", sorted(CASES))
def test_builtin_pipeline_resolves_to_the_source_verified_block_lists(tiny, class_name):
    components = CASES[class_name]
    pipe = tiny.pipeline(class_name, **components)
    resolved = resolve_offload_plan(pipe, BOTH)
    assert resolved.pipeline_class == class_name
    for path, kind in components.items():
        comp = resolved.component(path)
        assert comp.category == ("dit" if path.startswith("transformer") else "text_encoder"), path
        assert (comp.source, comp.action) == ("builtin", "stream"), path
        assert comp.replicated, path
        assert comp.resident_allowed == (comp.category == "dit"), path
        expected = EXPECTED_LISTS[kind]
        assert [s.attr_path for s in comp.stacks] == list(expected), path
        for stack in comp.stacks:
            assert stack.owner_path == path and not stack.own_chain
            assert stack.num_blocks == 2 and all(b > 0 for b in stack.block_bytes)
            for block_path in stack.block_paths:
                assert type(lookup(pipe, block_path)).__name__ == expected[stack.attr_path], block_path


def test_every_registered_pipeline_class_is_tested_and_exists_in_diffusers():
    import diffusers

    assert set(BUILTIN_FAMILIES) == set(CASES)
    for name in BUILTIN_FAMILIES:
        assert isinstance(getattr(diffusers, name), type), name


def test_every_registered_text_encoder_class_is_tested_and_exists_in_transformers(tiny):
    import transformers

    kinds = {kind for case in CASES.values() for path, kind in case.items() if path.startswith("text_encoder")}
    tested = {type(tiny.get(kind)).__name__ for kind in kinds}
    assert tested == set(TEXT_ENCODER_BLOCK_ATTRS)
    for name in TEXT_ENCODER_BLOCK_ATTRS:
        assert isinstance(getattr(transformers, name), type), name


def test_builtin_plans_are_offload_plans(tiny):
    plan = builtin_plan_for(tiny.pipeline("FluxPipeline", **_FLUX))
    assert isinstance(plan, OffloadPlan)
    assert dict(plan.block_attrs) == {"transformer": ("transformer_blocks", "single_transformer_blocks")}
    assert plan.resident_dit_paths == {"transformer"}
    assert dict(plan.encoder_component_types) == {"text_encoder": "text_encoder", "text_encoder_2": "text_encoder"}
    assert dict(plan.encoder_block_attrs) == {"text_encoder": ("encoder.layers",), "text_encoder_2": ("encoder.block",)}
    assert plan.encoder_dlo_weight_replication == {"text_encoder", "text_encoder_2"}
    for family in {id(f): f for f in BUILTIN_FAMILIES.values()}.values():
        assert isinstance(family.dit, OffloadPlan)


def test_unknown_pipelines_and_bare_models_have_no_builtin_plan(tiny):
    assert builtin_plan_for(tiny.get("wan")) is None
    assert builtin_plan_for(nn.Module()) is None


def test_subclasses_of_registered_pipelines_use_the_builtin_plan(tiny):
    from diffusers import WanPipeline

    class MyWanPipeline(WanPipeline):
        pass

    assert builtin_family_for(MyWanPipeline.__new__(MyWanPipeline)) is BUILTIN_FAMILIES["WanPipeline"]
    pipe = MyWanPipeline(
        tokenizer=None, text_encoder=tiny.get("umt5"), vae=None, scheduler=None, transformer=tiny.get("wan")
    )
    assert resolve_offload_plan(pipe, BOTH).component("transformer").source == "builtin"


def test_wan_21_without_transformer_2(tiny):
    pipe = tiny.pipeline("WanPipeline", **_WAN)  # transformer_2 is None: the plan names it, it is skipped
    resolved = resolve_offload_plan(pipe, BOTH)
    assert [c.path for c in resolved.components] == ["text_encoder", "transformer"]


def test_builtin_plan_covers_blocks_automatic_discovery_misses(tiny):
    # HunyuanVideo's token-replace blocks are not among the classes the model names in _repeated_blocks
    assert find_block_lists(tiny.get("hunyuan_token_replace")) == ()
    # Qwen2.5-VL names its vision blocks as well; the built-in plan streams only the language model
    assert set(find_block_lists(tiny.get("qwen25_vl"))) == {"model.visual.blocks", "model.language_model.layers"}
    pipe = tiny.pipeline("QwenImagePipeline", **_QWEN)
    stacks = resolve_offload_plan(pipe, BOTH).component("text_encoder").stacks
    assert [s.qualified_name for s in stacks] == ["text_encoder.model.language_model.layers"]


class Block(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)


class CustomTextEncoder(nn.Module):
    """A text encoder class the registry does not know, naming its blocks the transformers way."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))


class CLIPTextModel(nn.Module):
    """Same name as the transformers class, with the transformers 4.x layout (``text_model.encoder.layers``)."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.text_model = nn.Module()
        self.text_model.encoder = nn.Module()
        self.text_model.encoder.layers = nn.ModuleList(Block() for _ in range(2))


def test_an_unexpected_text_encoder_class_falls_back_to_discovery(tiny):
    # WanPipeline with a T5 (not UMT5) encoder: still built in, since T5's layout is registered too
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="t5")
    assert resolve_offload_plan(pipe, BOTH).component("text_encoder").source == "builtin"
    # an encoder class the registry does not know: automatic discovery, and the DiT is unaffected
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder=CustomTextEncoder())
    resolved = resolve_offload_plan(pipe, BOTH)
    assert resolved.component("text_encoder").source == "auto"
    assert resolved.component("transformer").source == "builtin"


def test_a_registered_encoder_class_with_another_layout_falls_back(tiny):
    pipe = tiny.pipeline("FluxPipeline", transformer="flux", text_encoder=CLIPTextModel(), text_encoder_2="t5")
    assert "text_encoder" not in builtin_plan_for(pipe).encoder_block_attrs
    comp = resolve_offload_plan(pipe, BOTH).component("text_encoder")
    assert comp.source == "auto"
    assert [s.qualified_name for s in comp.stacks] == ["text_encoder.text_model.encoder.layers"]
