"""Output geometry a pipeline accepts: its kind (image or video), the size multiple of height and width, and the
frame rule of video."""

from __future__ import annotations

import inspect
import math
from typing import Any, Literal

PipelineKind = Literal["video", "image"]


def pipeline_kind(pipeline: Any) -> PipelineKind:
    """``"video"`` if the pipeline's ``__call__`` takes ``num_frames`` (Wan, HunyuanVideo, LTX...), else ``"image"``."""
    if not callable(pipeline):
        raise TypeError(f"{type(pipeline).__name__} is not callable, so it is not a diffusers pipeline")
    return "video" if "num_frames" in inspect.signature(pipeline.__call__).parameters else "image"


def pipeline_size_multiple(pipeline: Any) -> int:
    """Pixels per latent token along a side: VAE compression x patch, or the processor's (Flux packs 2x2)."""
    processor_multiple = 1
    for name in ("image_processor", "video_processor"):
        processor = getattr(pipeline, name, None)
        factor = getattr(getattr(processor, "config", None), "vae_scale_factor", None)
        if isinstance(factor, int) and factor > 0:
            processor_multiple = math.lcm(processor_multiple, factor)
    return math.lcm(_pixels_per_token(pipeline), processor_multiple)


def pipeline_frame_multiple(pipeline: Any) -> int | None:
    """Video: ``num_frames - 1`` must be a multiple of the VAE's temporal compression (None: any count)."""
    temporal = getattr(pipeline, "vae_scale_factor_temporal", None)
    return temporal if isinstance(temporal, int) and temporal > 1 else None


def pipeline_max_latent_positions(pipeline: Any) -> int | None:
    """Most latent tokens along one axis its transformers (the smaller of two experts) can position, or None:
    Wan's ``rope_max_seq_len``, past which the first block fails after the text encoder has run."""
    limits = []
    for name in ("transformer", "transformer_2"):
        config = getattr(getattr(pipeline, name, None), "config", None)
        value = getattr(config, "rope_max_seq_len", None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limits.append(value)
    return min(limits) if limits else None


def pipeline_max_side(pipeline: Any) -> int | None:
    """Largest height or width in pixels the transformer can position (None: no such limit is declared)."""
    positions = pipeline_max_latent_positions(pipeline)
    return None if positions is None else positions * _pixels_per_token(pipeline)


def pipeline_max_frames(pipeline: Any) -> int | None:
    """Video: most frames the transformer can position (None: no such limit is declared)."""
    positions = pipeline_max_latent_positions(pipeline)
    if positions is None:
        return None
    temporal = pipeline_frame_multiple(pipeline) or 1
    latent_frames = positions * _patch(pipeline, axis=0)  # latent frames = (num_frames - 1) / temporal + 1
    return (latent_frames - 1) * temporal + 1


def _pixels_per_token(pipeline: Any) -> int:
    """VAE spatial compression x the transformer's spatial patch size."""
    spatial = getattr(pipeline, "vae_scale_factor_spatial", None) or getattr(pipeline, "vae_scale_factor", None) or 1
    return int(spatial) * _patch(pipeline, axis=-1)


def _patch(pipeline: Any, *, axis: int) -> int:
    """The transformer's patch along `axis` of (time, height, width); 1 if none (an int: no time axis)."""
    config = getattr(getattr(pipeline, "transformer", None), "config", None)
    patch_size = getattr(config, "patch_size", None) if config is not None else None
    if isinstance(patch_size, int):
        return patch_size if axis != 0 else 1
    if isinstance(patch_size, (tuple, list)) and patch_size:
        return int(patch_size[axis])
    return 1
