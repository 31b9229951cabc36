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
