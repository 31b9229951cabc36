"""Image-conditioned pipelines (Wan I2V and Wan 2.2 TI2V, Flux Kontext, Qwen-Image-Edit): their DiTs and text
encoders stream from the built-in plans, and their image encoders stay resident, saying why."""

from __future__ import annotations

import json

import pytest

from layerstream.plan.builtin_plans import builtin_family_for
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}


@pytest.fixture(scope="module")
def clip_vision():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=8
    )
    return CLIPVisionModelWithProjection(config)


def _image_encoder_is_resident_with_its_reason(resolved) -> None:
    encoder = resolved.component("image_encoder")
    assert (encoder.category, encoder.action, encoder.stacks) == ("image_encoder", "resident", ())
    assert "image encoders stay resident" in encoder.reason


@pytest.mark.parametrize("config", [LAYER, MODULE])
def test_wan_i2v_streams_its_dit_and_keeps_the_clip_image_encoder_resident(tiny, clip_vision, config):
    pipe = tiny.pipeline(
        "WanImageToVideoPipeline", transformer="wan", text_encoder="umt5", image_encoder=clip_vision
    )
    resolved = resolve_offload_plan(pipe, config)
    acting = "stream" if config["mode"] == "layer" else "swap"
    assert resolved.component("transformer").action == acting
    assert resolved.component("text_encoder").action == acting
    assert resolved.component("transformer").source == "builtin"
    _image_encoder_is_resident_with_its_reason(resolved)


@pytest.mark.parametrize("class_name", ["WanPipeline", "WanImageToVideoPipeline"])
def test_wan_22_ti2v_is_the_wan_family_with_expand_timesteps(tiny, class_name):
    """Wan 2.2 TI2V 5B ships as a WanPipeline folder (expand_timesteps=True, one transformer, no image encoder)
    and is loaded as WanImageToVideoPipeline for image to video: both are the Wan family's built-in plan."""
    import diffusers

    pipe = getattr(diffusers, class_name)(
        tokenizer=None, text_encoder=tiny.get("umt5"), vae=None, scheduler=None,
        transformer=tiny.get("wan"), expand_timesteps=True,
    )  # fmt: skip
    assert pipe.config.expand_timesteps is True
    assert builtin_family_for(pipe).pipelines[0] == "WanPipeline"
    resolved = resolve_offload_plan(pipe, LAYER)
    assert {c.path for c in resolved.streamed} == {"text_encoder", "transformer"}
    assert all(c.source == "builtin" for c in resolved.streamed)


def test_flux_kontext_keeps_its_image_encoder_resident(tiny, clip_vision):
    pipe = tiny.pipeline(
        "FluxKontextPipeline", transformer="flux", text_encoder="clip", text_encoder_2="t5", image_encoder=clip_vision
    )
    resolved = resolve_offload_plan(pipe, LAYER)
    assert {c.path for c in resolved.streamed} == {"transformer", "text_encoder", "text_encoder_2"}
    _image_encoder_is_resident_with_its_reason(resolved)


def test_qwen_image_edit_streams_the_language_layers_and_keeps_the_vision_tower(tiny):
    pipe = tiny.pipeline("QwenImageEditPipeline", transformer="qwenimage", text_encoder="qwen25_vl")
    resolved = resolve_offload_plan(pipe, LAYER)
    encoder = resolved.component("text_encoder")
    assert encoder.action == "stream" and [s.attr_path for s in encoder.stacks] == ["model.language_model.layers"]
    assert "vision tower" in encoder.reason
    # the vision tower is part of the component but not of its blocks: it stays on the device
    visual_bytes = sum(p.numel() * p.element_size() for p in pipe.text_encoder.model.visual.parameters())
    assert encoder.total_bytes - encoder.block_bytes >= visual_bytes


def test_plan_cli_reports_the_image_encoder_of_tiny_wan_i2v_as_resident_and_why(capsys):
    from layerstream.cli.main import main

    assert main(["plan", "tiny-wan-i2v", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    by_path = {c["path"]: c for c in plan["components"]}
    assert by_path["image_encoder"]["action"] == "resident"
    assert "image encoders stay resident" in by_path["image_encoder"]["reason"]
    assert by_path["transformer"]["action"] == "stream"

    assert main(["plan", "tiny-wan-i2v"]) == 0
    table = capsys.readouterr().out
    why = table.split("why:")[1]
    assert any(line.split()[:2] == ["image_encoder", "resident:"] for line in why.splitlines())
