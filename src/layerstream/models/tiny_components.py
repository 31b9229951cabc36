"""The embedded tiny models' components (``build_*_components()``: a pipeline's keyword arguments), real classes
at toy sizes, each module under its own fixed seed. A generation takes well under a second on a CPU, with what
offloading cares about: several blocks per block list, two text-encoder layers, two Wan 2.2 experts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
)
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from layerstream.models.tokenizers import (
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
)

# Shared toy sizes. Attention heads are 16 wide so that every model's rotary split (Wan's t/h/w thirds,
# Flux's and Qwen's axes_dims_rope) still has even parts.
NUM_DIT_BLOCKS = 3
NUM_TEXT_ENCODER_LAYERS = 2
TEXT_HIDDEN_SIZE = 32
DIT_HEAD_DIM = 16
DIT_NUM_HEADS = 2
LATENT_CHANNELS = 4
# The (CLIP, Qwen2.5) transformer encoders' toy sizes, in transformers' names (T5 names them its own way).
_ENCODER_SIZES: dict[str, Any] = {
    "hidden_size": TEXT_HIDDEN_SIZE,
    "intermediate_size": 2 * TEXT_HIDDEN_SIZE,
    "num_hidden_layers": NUM_TEXT_ENCODER_LAYERS,
    "num_attention_heads": 4,
}
# What the Flux and Qwen-Image DiTs share: latents packed into 2x2 patches, joint attention over the text
# encoder's hidden states, and the toy sizes.
_PACKED_LATENT_DIT: dict[str, Any] = {
    "in_channels": 4 * LATENT_CHANNELS,
    "num_layers": NUM_DIT_BLOCKS,
    "attention_head_dim": DIT_HEAD_DIM,
    "num_attention_heads": DIT_NUM_HEADS,
    "joint_attention_dim": TEXT_HIDDEN_SIZE,
}


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build under a fixed seed, leaving the caller's random state as it was."""
    with torch.random.fork_rng(devices=[]):  # devices=[]: CPU state only; these models are built on the host
        torch.manual_seed(seed)
        yield


def _t5_config(config_class: type, tokenizer: Any) -> Any:
    """A two-layer (U)T5 encoder config with gated-GELU feed-forward, as Wan's UMT5 and Flux's T5 use."""
    return config_class(
        vocab_size=len(tokenizer),
        d_model=TEXT_HIDDEN_SIZE,
        d_kv=TEXT_HIDDEN_SIZE // 4,
        d_ff=2 * TEXT_HIDDEN_SIZE,
        num_layers=NUM_TEXT_ENCODER_LAYERS,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


# Wan 2.2 A14B switches from the high-noise expert (`transformer`) to the low-noise one (`transformer_2`) at
# timestep boundary_ratio * 1000. With flow_shift 3 and 4 steps the timesteps are ~999, 900, 750, 500: two each.
WAN_BOUNDARY_RATIO = 0.875


def _wan_transformer(**image_conditioning: Any) -> WanTransformer3DModel:
    """A Wan DiT; image-to-video passes its wider input and its image cross-attention (see `build_wan_i2v_components`)."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=DIT_NUM_HEADS,
        attention_head_dim=DIT_HEAD_DIM,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_HIDDEN_SIZE,
        freq_dim=32,
        ffn_dim=64,
        num_layers=NUM_DIT_BLOCKS,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
        **{"in_channels": LATENT_CHANNELS, **image_conditioning},
    )


def _wan_vae(vae_class: type = AutoencoderKLWan) -> Any:
    # 8x spatial and 4x temporal compression, as the real Wan 2.1 / 2.2 A14B VAE. Qwen-Image's VAE is the same
    # architecture (its own class), built here at the same toy size.
    return vae_class(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
    )


def _wan_scheduler() -> UniPCMultistepScheduler:
    """Wan's scheduler (Wan 2.2 T2V and Wan 2.1 I2V alike): UniPC over flow-matching sigmas, shift 3 (480p)."""
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _wan_shared_components(seed: int) -> dict[str, Any]:
    """The UMT5 text encoder (under `seed`), its tokenizer, the Wan VAE (`seed` + 3), the scheduler."""
    tokenizer = build_t5_tokenizer()
    with _seeded(seed):
        text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, tokenizer))
    with _seeded(seed + 3):
        vae = _wan_vae()
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": _wan_scheduler()}


def _wan_two_experts(seed: int, boundary_ratio: float, **image_conditioning: Any) -> dict[str, Any]:
    """A Wan 2.2 A14B-style pipeline's keyword arguments: two DiT experts (under `seed` + 1 and + 2)."""
    with _seeded(seed + 1):
        transformer = _wan_transformer(**image_conditioning)
    with _seeded(seed + 2):
        transformer_2 = _wan_transformer(**image_conditioning)
    return {
        **_wan_shared_components(seed),
        "transformer": transformer,
        "transformer_2": transformer_2,
        "boundary_ratio": boundary_ratio,
    }


def build_wan_components() -> dict[str, Any]:
    """Keyword arguments for a Wan 2.2-style `WanPipeline` (UMT5 text encoder, two experts, Wan VAE)."""
    return _wan_two_experts(1, WAN_BOUNDARY_RATIO)


# The CLIP vision tower sees the input image at this size (the real one at 224): 4x4 patches of 8 pixels.
CLIP_IMAGE_SIZE = 32
# The VAE's temporal compression: the conditioning mask has one channel per frame a latent frame covers.
WAN_TEMPORAL_COMPRESSION = 4


def build_wan_i2v_components() -> dict[str, Any]:
    """Wan 2.1 I2V-style: a CLIP vision encoder, one DiT whose input stacks latents, first-frame mask and encoded
    image (16 + 4 + 16 in the real one) and whose blocks take the CLIP states through added key/value projections."""
    with _seeded(32):
        image_encoder = CLIPVisionModel(
            CLIPVisionConfig(
                **_ENCODER_SIZES,
                image_size=CLIP_IMAGE_SIZE,
                patch_size=8,
                projection_dim=TEXT_HIDDEN_SIZE,
                hidden_act="quick_gelu",
            )
        )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": CLIP_IMAGE_SIZE}, crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE}
    )
    with _seeded(33):
        transformer = _wan_transformer(
            in_channels=2 * LATENT_CHANNELS + WAN_TEMPORAL_COMPRESSION,
            image_dim=TEXT_HIDDEN_SIZE,
            added_kv_proj_dim=DIT_NUM_HEADS * DIT_HEAD_DIM,
        )
    return {
        **_wan_shared_components(31),
        "image_processor": image_processor,
        "image_encoder": image_encoder,
        "transformer": transformer,
    }


# Wan 2.2 I2V A14B hands over to its low-noise expert at 0.9 of the timesteps: with flow_shift 3 and 4 steps, the
# timesteps ~999 and 900 run on the high-noise expert, 750 and 500 on the low-noise one.
WAN22_I2V_BOUNDARY_RATIO = 0.9


def build_wan22_i2v_components() -> dict[str, Any]:
    """Wan 2.2 I2V A14B-style: two experts that take the input image as latent channels only."""
    return _wan_two_experts(41, WAN22_I2V_BOUNDARY_RATIO, in_channels=2 * LATENT_CHANNELS + WAN_TEMPORAL_COMPRESSION)


def _shifted_flow_scheduler(**shift: Any) -> FlowMatchEulerDiscreteScheduler:
    """Flux.1-dev's and Qwen-Image's scheduler: flow-matching Euler with a resolution-dependent shift."""
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256, **shift)


def build_flux_components() -> dict[str, Any]:
    """Keyword arguments for a Flux.1-dev-style `FluxPipeline` (CLIP + T5 text encoders, 8x VAE)."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    with _seeded(11):
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                **_ENCODER_SIZES,
                vocab_size=len(tokenizer),
                max_position_embeddings=tokenizer.model_max_length,
                projection_dim=TEXT_HIDDEN_SIZE,
                hidden_act="quick_gelu",
                # The pooled output is read at the first end-of-text token, found by this id.
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    with _seeded(12):
        text_encoder_2 = T5EncoderModel(_t5_config(T5Config, tokenizer_2))
    with _seeded(13):
        transformer = FluxTransformer2DModel(
            **_PACKED_LATENT_DIT,
            patch_size=1,
            num_single_layers=NUM_DIT_BLOCKS,
            pooled_projection_dim=TEXT_HIDDEN_SIZE,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    with _seeded(14):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),  # four levels: 8x compression, as the real Flux VAE
            layers_per_block=1,
            latent_channels=LATENT_CHANNELS,
            norm_num_groups=4,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
    return {
        "scheduler": _shifted_flow_scheduler(shift=3.0, max_shift=1.15, max_image_seq_len=4096),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
    }


def build_qwen_image_components() -> dict[str, Any]:
    """Keyword arguments for a `QwenImagePipeline` (Qwen2.5-VL text encoder, Qwen-Image VAE)."""
    tokenizer = build_qwen2_tokenizer()
    special_id = tokenizer.convert_tokens_to_ids
    with _seeded(21):
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    **_ENCODER_SIZES,
                    "vocab_size": len(tokenizer),
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 2048,
                    # Multimodal RoPE: sections (t, h, w) must add up to half the head size (8 / 2).
                    "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
                    "bos_token_id": tokenizer.pad_token_id,
                    "eos_token_id": special_id("<|im_end|>"),
                    "pad_token_id": tokenizer.pad_token_id,
                },
                # The vision tower is never used for text-to-image; it only has to exist, so keep it tiny.
                vision_config={
                    "depth": 2,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": TEXT_HIDDEN_SIZE,
                    "fullatt_block_indexes": [1],
                },
                image_token_id=special_id("<|image_pad|>"),
                video_token_id=special_id("<|video_pad|>"),
                vision_start_token_id=special_id("<|vision_start|>"),
                vision_end_token_id=special_id("<|vision_end|>"),
            )
        )
    with _seeded(22):
        transformer = QwenImageTransformer2DModel(
            **_PACKED_LATENT_DIT,
            patch_size=2,
            out_channels=LATENT_CHANNELS,
            axes_dims_rope=(8, 4, 4),
        )
    with _seeded(23):
        vae = _wan_vae(AutoencoderKLQwenImage)  # 8x compression, as the real Qwen-Image VAE
    # Qwen-Image's scheduler: an exponential shift
    scheduler = _shifted_flow_scheduler(
        shift=1.0, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
