"""Tiny random-weight models and pipelines for the plan tests, built from configs in code (no hub access).

Every model has 2 blocks per block list and dimensions of a few units, so building all of them takes a
second or two. `tiny` hands out one cached instance per kind: the resolver only reads modules, so tests
may share them (the purity test proves it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

NUM_LAYERS = 2
_PIPELINE_FLAGS = ("boundary_ratio", "expand_timesteps", "is_distilled")  # non-module __init__ arguments


class TinyModels:
    """Cached tiny models by kind (``tiny.get("wan")``) and diffusers pipelines built from them."""

    def get(self, kind: str) -> torch.nn.Module:
        """The shared instance of `kind`; tests must not change it."""
        return _build(kind)

    def fresh(self, kind: str) -> torch.nn.Module:
        """A new instance of `kind`, for tests that change the model (hooks) before resolving."""
        return _build.__wrapped__(kind)

    def pipeline(self, class_name: str, **components: str | torch.nn.Module | None) -> Any:
        """A diffusers pipeline `class_name` whose listed components are tiny models (by kind) and whose other
        __init__ arguments (tokenizers, schedulers, VAEs) are None."""
        import diffusers

        cls = getattr(diffusers, class_name)
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self" and p not in _PIPELINE_FLAGS]
        kwargs: dict[str, Any] = dict.fromkeys(params)
        for name, value in components.items():
            assert name in kwargs, f"{class_name} has no component {name}"
            kwargs[name] = self.get(value) if isinstance(value, str) else value
        with _quiet("diffusers"):
            return cls(**kwargs)


@pytest.fixture(scope="session")
def tiny() -> TinyModels:
    return TinyModels()


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a library's logger (pipelines warn about the None tokenizers and schedulers)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@functools.cache
def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with _quiet("transformers"), _quiet("diffusers"):
        return _BUILDERS[kind]().eval()


# --- diffusers DiTs --------------------------------------------------------------------------------------

_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=4, in_channels=4, out_channels=4, text_dim=8,
    freq_dim=8, ffn_dim=16, num_layers=NUM_LAYERS, rope_max_seq_len=32,
)  # fmt: skip
_HUNYUAN = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=4, num_layers=NUM_LAYERS,
    num_single_layers=NUM_LAYERS, num_refiner_layers=NUM_LAYERS, patch_size=1, text_embed_dim=8,
    pooled_projection_dim=8, rope_axes_dim=(2, 2, 0),
)  # fmt: skip


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**_WAN)


def _wan_vace():
    from diffusers import WanVACETransformer3DModel

    return WanVACETransformer3DModel(**_WAN, vace_layers=[0, 1], vace_in_channels=8)


def _wan_animate():
    from diffusers import WanAnimateTransformer3DModel

    return WanAnimateTransformer3DModel(
        **{**_WAN, "in_channels": 12, "out_channels": 4}, latent_channels=4, image_dim=8, motion_encoder_size=16,
        motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
        inject_face_latents_blocks=1, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8, "32": 8, "64": 8},
    )  # fmt: skip


def _flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        in_channels=4, num_layers=NUM_LAYERS, num_single_layers=NUM_LAYERS, attention_head_dim=4,
        num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8, axes_dims_rope=(0, 2, 2),
    )  # fmt: skip


def _flux2():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        in_channels=4, num_layers=NUM_LAYERS, num_single_layers=NUM_LAYERS, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=8, timestep_guidance_channels=8, axes_dims_rope=(2, 2, 2, 2),
    )  # fmt: skip


def _qwenimage():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        in_channels=16, out_channels=4, num_layers=NUM_LAYERS, attention_head_dim=4, num_attention_heads=2,
        joint_attention_dim=8, axes_dims_rope=(0, 2, 2),
    )  # fmt: skip


def _hunyuan():
    from diffusers import HunyuanVideoTransformer3DModel

    return HunyuanVideoTransformer3DModel(**_HUNYUAN)


def _hunyuan_token_replace():
    from diffusers import HunyuanVideoTransformer3DModel

    return HunyuanVideoTransformer3DModel(**_HUNYUAN, image_condition_type="token_replace")


def _framepack():
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    return HunyuanVideoFramepackTransformer3DModel(**_HUNYUAN)


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=4, cross_attention_dim=8,
        num_layers=NUM_LAYERS, caption_channels=8,
    )  # fmt: skip


def _sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=NUM_LAYERS, attention_head_dim=4,
        num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=8, pooled_projection_dim=8,
        out_channels=4, pos_embed_max_size=8,
    )  # fmt: skip


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=NUM_LAYERS, sample_width=8, sample_height=8, sample_frames=5,
        max_text_seq_length=8,
    )  # fmt: skip


def _hidream():
    from diffusers import HiDreamImageTransformer2DModel

    # caption_channels: (T5 width, Llama width); text_emb_dim: the two CLIP pooled outputs side by side
    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=NUM_LAYERS, num_single_layers=NUM_LAYERS,
        attention_head_dim=8, num_attention_heads=2, caption_channels=[8, 8], text_emb_dim=16,
        num_routed_experts=2, num_activated_experts=1, axes_dims_rope=(4, 2, 2), max_resolution=(8, 8),
        llama_layers=[0, 1] * NUM_LAYERS,
    )  # fmt: skip


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])


# --- transformers text encoders --------------------------------------------------------------------------

_DECODER = dict(
    vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
    num_key_value_heads=1, head_dim=4, max_position_embeddings=32,
)  # fmt: skip
_T5 = dict(
    vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=NUM_LAYERS, num_heads=2, relative_attention_num_buckets=4
)
_CLIP_TEXT = dict(
    vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
    max_position_embeddings=16, projection_dim=8,
)  # fmt: skip
_VISION = dict(
    hidden_size=8, intermediate_size=16, num_hidden_layers=NUM_LAYERS, num_attention_heads=2, image_size=8, patch_size=4
)


def _umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**_T5))


def _t5():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**_T5))


def _clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**_CLIP_TEXT))


def _clip_projection():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(**_CLIP_TEXT))


def _llama():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(**_DECODER))


def _llama_causal():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_DECODER))


def _llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text, vision = LlamaConfig(**_DECODER), CLIPVisionConfig(**_VISION)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=31)
    return LlavaForConditionalGeneration(config)


def _mistral3():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(**_VISION)
    config = Mistral3Config(text_config=MistralConfig(**_DECODER), vision_config=vision, image_token_index=31)
    return Mistral3ForConditionalGeneration(config)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_DECODER))


def _qwen25_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        depth=NUM_LAYERS, hidden_size=8, intermediate_size=16, num_heads=2, out_hidden_size=8, patch_size=2,
        spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[1], window_size=4,
    )  # fmt: skip
    text = {**_DECODER, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1]}}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


_BUILDERS = {
    "wan": _wan,
    "wan_2": _wan,  # a second, distinct instance for transformer_2
    "wan_vace": _wan_vace,
    "wan_animate": _wan_animate,
    "flux": _flux,
    "flux2": _flux2,
    "qwenimage": _qwenimage,
    "hunyuan": _hunyuan,
    "hunyuan_token_replace": _hunyuan_token_replace,
    "framepack": _framepack,
    "ltx": _ltx,
    "sd3": _sd3,
    "cogvideox": _cogvideox,
    "hidream": _hidream,
    "wan_vae": _wan_vae,
    "umt5": _umt5,
    "t5": _t5,
    "clip": _clip,
    "clip_projection": _clip_projection,
    "clip_projection_2": _clip_projection,
    "llama": _llama,
    "llama_causal": _llama_causal,
    "llava": _llava,
    "mistral3": _mistral3,
    "qwen3": _qwen3,
    "qwen25_vl": _qwen25_vl,
}
