"""Output geometry a pipeline accepts: the size multiple of height and width, and the frame rule of video."""

from __future__ import annotations

import math
from typing import Any


def pipeline_size_multiple(pipeline: Any) -> int:
    """Pixels per latent token along each side: VAE spatial compression x transformer patch size.

    Pipelines that pack latents into 2x2 patches themselves (Flux, Qwen-Image) declare it through their image
    processor's ``vae_scale_factor`` rather than the transformer's patch size, so the answer is the least
    common multiple of both readings.
    """
    spatial = getattr(pipeline, "vae_scale_factor_spatial", None) or getattr(pipeline, "vae_scale_factor", None) or 1
    patch = 1
    transformer = getattr(pipeline, "transformer", None)
    config = getattr(transformer, "config", None)
    patch_size = getattr(config, "patch_size", None) if config is not None else None
    if isinstance(patch_size, int):
        patch = patch_size
    elif isinstance(patch_size, (tuple, list)) and patch_size:
        patch = int(patch_size[-1])  # (temporal, height, width): the spatial patch is the last
    processor_multiple = 1
    for name in ("image_processor", "video_processor"):
        processor = getattr(pipeline, name, None)
        factor = getattr(getattr(processor, "config", None), "vae_scale_factor", None)
        if isinstance(factor, int) and factor > 0:
            processor_multiple = math.lcm(processor_multiple, factor)
    return math.lcm(int(spatial) * patch, processor_multiple)


def pipeline_frame_multiple(pipeline: Any) -> int | None:
    """Video: ``num_frames - 1`` must be a multiple of the VAE's temporal compression (None: any count)."""
    temporal = getattr(pipeline, "vae_scale_factor_temporal", None)
    return temporal if isinstance(temporal, int) and temporal > 1 else None


# Transformer config keys that give the number of positions a precomputed rotary table holds along each axis
# (Wan: ``rope_max_seq_len``). Going past it does not fail cleanly inside the model ("view size is not
# compatible"), so the largest size is computed from it and checked before a generation starts. Models that
# compute their rotary embedding for any length (Flux, Qwen-Image) declare none.
POSITION_TABLE_KEYS = ("rope_max_seq_len",)


def pipeline_max_side(pipeline: Any) -> int | None:
    """The largest height or width the transformer's position table covers (None: no limit of the model's)."""
    positions = _position_table_size(pipeline)
    if positions is None:
        return None
    spatial = getattr(pipeline, "vae_scale_factor_spatial", None) or getattr(pipeline, "vae_scale_factor", None) or 1
    patch = _patch_sizes(pipeline)
    return positions * int(spatial) * patch[-1]


def pipeline_max_frames(pipeline: Any) -> int | None:
    """Video: the largest ``num_frames`` the transformer's position table covers (None: no such limit)."""
    positions = _position_table_size(pipeline)
    temporal = pipeline_frame_multiple(pipeline)
    if positions is None or temporal is None:
        return None
    latent_frames = positions * _patch_sizes(pipeline)[0]
    return (latent_frames - 1) * temporal + 1


def _position_table_size(pipeline: Any) -> int | None:
    config = getattr(getattr(pipeline, "transformer", None), "config", None)
    for key in POSITION_TABLE_KEYS:
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _patch_sizes(pipeline: Any) -> tuple[int, int]:
    """(temporal, spatial) patch size of the transformer; 1 where it declares none."""
    config = getattr(getattr(pipeline, "transformer", None), "config", None)
    patch_size = getattr(config, "patch_size", None) if config is not None else None
    if isinstance(patch_size, int):
        return 1, patch_size
    if isinstance(patch_size, (tuple, list)) and patch_size:
        return (int(patch_size[0]) if len(patch_size) == 3 else 1), int(patch_size[-1])
    return 1, 1
