"""The embedded tiny models: built into the cache, reloaded through from_pretrained, generating deterministically."""

from __future__ import annotations

import inspect
import json
import logging

import numpy as np
import pytest
import torch

from layerstream.models import (
    TINY_MODELS,
    build_tiny_pipeline_components,
    ensure_tiny_model,
    load_pipeline,
    pipeline_kind,
)

NAMES = list(TINY_MODELS)

# Block lists offloading streams, per component: each must have at least 3 (DiT) or 2 (text encoder) entries.
BLOCK_LISTS = {
    "tiny-wan": {"transformer": ["blocks"], "transformer_2": ["blocks"], "text_encoder": ["encoder.block"]},
    "tiny-flux": {
        "transformer": ["transformer_blocks", "single_transformer_blocks"],
        "text_encoder": ["encoder.layers"],
        "text_encoder_2": ["encoder.block"],
    },
    "tiny-qwen-image": {"transformer": ["transformer_blocks"], "text_encoder": ["model.language_model.layers"]},
    "tiny-wan-i2v": {"transformer": ["blocks"], "text_encoder": ["encoder.block"], "image_encoder": ["encoder.layers"]},
    "tiny-wan22-i2v": {"transformer": ["blocks"], "transformer_2": ["blocks"], "text_encoder": ["encoder.block"]},
}


def _input_image(height: int, width: int):
    """A fixed test image for the image-to-video model, at the size it should generate."""
    from PIL import Image

    pixels = (np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _generate(pipe, name, **overrides):
    kwargs = {**TINY_MODELS[name].default_kwargs, **overrides}
    kwargs.setdefault("prompt", "a red cat walking on the beach")
    if "image" in inspect.signature(pipe.__call__).parameters:
        kwargs.setdefault("image", _input_image(kwargs["height"], kwargs["width"]))
    out = pipe(output_type="np", generator=torch.Generator().manual_seed(0), **kwargs)
    return out.frames if TINY_MODELS[name].kind == "video" else out.images


def _count_calls(*modules):
    counts = [0] * len(modules)

    def counter(index):
        def hook(module, args, kwargs):
            counts[index] += 1

        return hook

    for index, module in enumerate(modules):
        module.register_forward_pre_hook(counter(index), with_kwargs=True)
    return counts


def _load(name):
    pipe = load_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", NAMES)
def test_built_into_the_session_cache_as_a_diffusers_folder(name, layerstream_cache):
    folder = ensure_tiny_model(name)
    assert folder == layerstream_cache / "models" / f"{name}-v1"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == TINY_MODELS[name].pipeline_class
    assert ensure_tiny_model(name) == folder


def test_respects_layerstream_cache_and_builds_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="layerstream.models.tiny"):
        folder = ensure_tiny_model("tiny-flux")
        ensure_tiny_model("tiny-flux")
    assert folder == tmp_path / "cache" / "models" / "tiny-flux-v1"
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built tiny model tiny-flux")]
    assert len(built) == 1 and str(folder) in built[0]


@pytest.mark.parametrize("name", NAMES)
def test_loaded_pipeline_has_the_declared_shape(name):
    pipe = _load(name)
    spec = TINY_MODELS[name]
    assert type(pipe).__name__ == spec.pipeline_class
    assert pipeline_kind(pipe) == spec.kind
    for component, block_lists in BLOCK_LISTS[name].items():
        minimum = 3 if component.startswith("transformer") else 2
        module = getattr(pipe, component)
        for path in block_lists:
            assert len(module.get_submodule(path)) >= minimum, f"{component}.{path}"
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert {p.dtype for p in component.parameters()} == {torch.float32}
            assert all(p.device.type == "cpu" for p in component.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_reloaded_weights_equal_a_fresh_build(name):
    """Weights come from fixed seeds: a fresh build equals what was saved and reloaded, tensor for tensor."""
    fresh = build_tiny_pipeline_components(name)
    pipe = _load(name)
    for component, module in fresh.items():
        if isinstance(module, torch.nn.Module):
            expected, loaded = module.state_dict(), getattr(pipe, component).state_dict()
            assert expected.keys() == loaded.keys(), component
            assert all(torch.equal(expected[key], loaded[key]) for key in expected), component


@pytest.mark.parametrize("name", NAMES)
def test_generation_is_deterministic_and_not_degenerate(name):
    pipe = _load(name)
    spec = TINY_MODELS[name]
    first, second = _generate(pipe, name), _generate(pipe, name)
    assert np.array_equal(first, second)
    size = (spec.default_kwargs["height"], spec.default_kwargs["width"], 3)
    if spec.kind == "video":
        assert first.shape == (1, spec.default_kwargs["num_frames"], *size)
    else:
        assert first.shape == (1, *size)
    assert np.isfinite(first).all() and first.std() > 0.01
    # The prompt reaches the image: text encoders and tokenizers are wired in, not ignored.
    assert not np.array_equal(first, _generate(pipe, name, prompt="a blue robot flying over the city"))


@pytest.mark.parametrize("name", NAMES)
def test_default_sizes_are_multiples_of_what_the_pipeline_needs(name):
    pipe = _load(name)
    spec = TINY_MODELS[name]
    if spec.kind == "video":
        needed = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    else:
        needed = pipe.image_processor.config.vae_scale_factor  # VAE factor x 2 for the packed 2x2 patches
    assert spec.size_multiple == needed
    assert spec.default_kwargs["height"] % needed == 0 and spec.default_kwargs["width"] % needed == 0


def test_wan_runs_both_experts_with_classifier_free_guidance():
    pipe = _load("tiny-wan")
    counts = _count_calls(pipe.transformer, pipe.transformer_2)
    steps = TINY_MODELS["tiny-wan"].default_kwargs["num_inference_steps"]
    assert TINY_MODELS["tiny-wan"].default_kwargs["guidance_scale"] > 1
    with_negative = _generate(pipe, "tiny-wan", negative_prompt="blurry, low quality")
    assert counts[0] > 0 and counts[1] > 0, "both experts must run"
    assert counts[0] + counts[1] == 2 * steps, "a conditional and an unconditional pass per step"
    assert not np.array_equal(with_negative, _generate(pipe, "tiny-wan"))


def test_flux_true_cfg_doubles_the_passes():
    pipe = _load("tiny-flux")
    counts = _count_calls(pipe.transformer)
    steps = TINY_MODELS["tiny-flux"].default_kwargs["num_inference_steps"]
    _generate(pipe, "tiny-flux")
    assert counts == [steps]  # guidance-distilled: guidance_scale is an input, one pass per step
    _generate(pipe, "tiny-flux", true_cfg_scale=2.0, negative_prompt="blurry")
    assert counts == [3 * steps]


def test_qwen_image_defaults_run_true_cfg():
    pipe = _load("tiny-qwen-image")
    counts = _count_calls(pipe.transformer)
    _generate(pipe, "tiny-qwen-image")
    assert counts == [2 * TINY_MODELS["tiny-qwen-image"].default_kwargs["num_inference_steps"]]


def test_qwen_image_system_prompt_length_matches_the_pipeline():
    """The pipeline drops a fixed count of leading tokens; our tokenizer must spell its system prompt in as many."""
    pipe = _load("tiny-qwen-image")
    system_prompt = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(system_prompt).input_ids) == pipe.prompt_template_encode_start_idx
