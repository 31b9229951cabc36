"""A catalogue of published models' dimensions, so that `layerstream plan` answers for them without the Hub: Wan 2.2
T2V-A14B and TI2V-5B, Flux.1-dev, Qwen-Image and HunyuanVideo, each as the diffusers-format folder of its Hub
repository describes it (``model_index.json`` and every component's config, in the dtype its checkpoint stores),
written by hand from the ``config.json`` files of those repositories and of their text encoders (google/umt5-xxl,
google/t5-v1_1-xxl, openai/clip-vit-large-patch14, Qwen/Qwen2.5-VL-7B-Instruct, xtuner/llava-llama-3-8b-v1_1's
language model): no weight, and no copied file (some repositories are gated or licensed against redistribution).
`models.loading.load_skeleton` uses it when the Hub cannot be reached or will not answer."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UMT5_XXL = {
    "model_type": "umt5", "architectures": ["UMT5EncoderModel"], "vocab_size": 256384, "d_model": 4096, "d_kv": 64,
    "d_ff": 10240, "num_layers": 24, "num_heads": 64, "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
}  # fmt: skip
T5_XXL = {**UMT5_XXL, "model_type": "t5", "architectures": ["T5EncoderModel"], "vocab_size": 32128}
CLIP_L = {
    "model_type": "clip_text_model", "architectures": ["CLIPTextModel"], "vocab_size": 49408, "hidden_size": 768,
    "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77,
    "projection_dim": 768, "hidden_act": "quick_gelu",
}  # fmt: skip
WAN_VAE = {"_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "attn_scales": [], "temperal_downsample": [False, True, True]}  # fmt: skip
WAN_DIT = {
    "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "rope_max_seq_len": 1024,
}  # fmt: skip
FLOW_MATCH = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True}


@dataclass(frozen=True)
class PublishedModel:
    """One model: its Hub id, pipeline class, components (name -> (library, class, config, stored dtype)) and the
    sizes it is usually run at (height, width, frames)."""

    hub_id: str
    pipeline_class: str
    components: dict[str, tuple[str, str, dict[str, Any], str]]
    sizes: tuple[tuple[int, int, int], ...]
    index_extra: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, PublishedModel] = {
    "Wan 2.2 T2V-A14B": PublishedModel(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanPipeline",
        {
            "transformer": ("diffusers", "WanTransformer3DModel", WAN_DIT, "BF16"),
            "transformer_2": ("diffusers", "WanTransformer3DModel", WAN_DIT, "BF16"),
            "text_encoder": ("transformers", "UMT5EncoderModel", UMT5_XXL, "BF16"),
            "vae": ("diffusers", "AutoencoderKLWan", WAN_VAE, "F32"),
            "scheduler": ("diffusers", "UniPCMultistepScheduler", {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}, ""),
        },
        ((480, 832, 81), (720, 1280, 81)),
        {"boundary_ratio": 0.875},
    ),
    "Wan 2.2 TI2V-5B": PublishedModel(
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "WanPipeline",
        {
            "transformer": ("diffusers", "WanTransformer3DModel", {
                **WAN_DIT, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48, "out_channels": 48,
            }, "BF16"),  # fmt: skip
            "text_encoder": ("transformers", "UMT5EncoderModel", UMT5_XXL, "BF16"),
            "vae": ("diffusers", "AutoencoderKLWan", {
                **WAN_VAE, "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12,
                "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
            }, "F32"),  # fmt: skip
            "scheduler": ("diffusers", "UniPCMultistepScheduler", {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 5.0}, ""),
        },
        ((704, 1280, 121),),
        {"expand_timesteps": True},
    ),
    "Flux.1-dev": PublishedModel(
        "black-forest-labs/FLUX.1-dev", "FluxPipeline",
        {
            "transformer": ("diffusers", "FluxTransformer2DModel", {
                "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
                "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
            }, "BF16"),  # fmt: skip
            "text_encoder": ("transformers", "CLIPTextModel", CLIP_L, "BF16"),
            "text_encoder_2": ("transformers", "T5EncoderModel", T5_XXL, "BF16"),
            "vae": ("diffusers", "AutoencoderKL", {
                "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 16,
                "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
                "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
            }, "BF16"),  # fmt: skip
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", FLOW_MATCH, ""),
        },
        ((1024, 1024, 1),),
    ),
    "Qwen-Image": PublishedModel(
        "Qwen/Qwen-Image", "QwenImagePipeline",
        {
            "transformer": ("diffusers", "QwenImageTransformer2DModel", {
                "_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64, "out_channels": 16,
                "num_layers": 60, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
            }, "BF16"),  # fmt: skip
            "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", {
                "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "text_config": {
                    "model_type": "qwen2_5_vl_text", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                },
                "vision_config": {
                    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
                    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                    "fullatt_block_indexes": [7, 15, 23, 31],
                },
            }, "BF16"),  # fmt: skip
            "vae": ("diffusers", "AutoencoderKLQwenImage", {**WAN_VAE, "_class_name": "AutoencoderKLQwenImage"}, "BF16"),
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", FLOW_MATCH, ""),
        },
        ((1328, 1328, 1), (928, 1664, 1)),
    ),
    "HunyuanVideo": PublishedModel(
        "hunyuanvideo-community/HunyuanVideo", "HunyuanVideoPipeline",
        {
            "transformer": ("diffusers", "HunyuanVideoTransformer3DModel", {
                "_class_name": "HunyuanVideoTransformer3DModel", "in_channels": 16, "out_channels": 16,
                "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 20, "num_single_layers": 40,
                "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 2, "patch_size_t": 1, "qk_norm": "rms_norm",
                "guidance_embeds": True, "text_embed_dim": 4096, "pooled_projection_dim": 768, "rope_theta": 256.0,
                "rope_axes_dim": [16, 56, 56],
            }, "BF16"),  # fmt: skip
            "text_encoder": ("transformers", "LlamaModel", {
                "model_type": "llama", "architectures": ["LlamaModel"], "vocab_size": 128320, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            }, "F16"),  # fmt: skip
            "text_encoder_2": ("transformers", "CLIPTextModel", CLIP_L, "F16"),
            "vae": ("diffusers", "AutoencoderKLHunyuanVideo", {"_class_name": "AutoencoderKLHunyuanVideo"}, "F16"),
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 7.0}, ""),
        },
        ((544, 960, 129), (720, 1280, 129)),
    ),
}
"""The catalogue, by the name docs/planning.md's machines table prints."""


def write_config_folder(model: PublishedModel, folder: Path) -> Path:
    """`model`'s diffusers-format folder without weights: `model_index.json` and each component's config."""
    folder.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": model.pipeline_class, "_diffusers_version": "0.35.0", **model.index_extra}
    for name, (library, class_name, config, _) in model.components.items():
        index[name] = [library, class_name]
        (folder / name).mkdir(exist_ok=True)
        filename = "scheduler_config.json" if name == "scheduler" else "config.json"
        (folder / name / filename).write_text(json.dumps(config, indent=1))
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    return folder


def published_model(hub_id: str) -> PublishedModel | None:
    """The catalogue's entry for `hub_id` (as the Hub spells it, any case), or None."""
    return next((model for model in MODELS.values() if model.hub_id.lower() == hub_id.lower()), None)


def published_skeleton(model: PublishedModel) -> Any:
    """`model`'s pipeline as a meta-device skeleton, each component in the dtype its checkpoint stores."""
    from layerstream.models.skeleton import build_skeleton

    # every tensor of a component in its one stored dtype (`_apply_dtypes_` gives a tensor the headers do not
    # name the component's most common dtype: here the only one)
    dtypes = {name: {"<every tensor>": dtype} for name, (_, _, _, dtype) in model.components.items() if dtype}
    with tempfile.TemporaryDirectory(prefix="layerstream-published-") as root:
        return build_skeleton(write_config_folder(model, Path(root)), dtypes)
