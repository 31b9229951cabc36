"""The device peak of a VAE decode, from the VAE's own structure: its decode runs on the meta device (config
only, no weight read) at the latents of the requested output, every tensor counted while alive (`meta_peak`), so
the trace follows whatever the VAE does (frame by frame with a feature cache, frames in batches, a whole image,
tiled as its ``enable_tiling()`` set it). The VAE's weights are apart (`DecodePeak.weight_nbytes`): resident in
layer mode, the planner counts them once; module mode swaps them in to decode (`decode_memory` adds them)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerstream.models.decode.conv_scratch import DeviceType
from layerstream.models.decode.meta_peak import trace_call

_TILING_ATTRIBUTES = ("tile_", "use_framewise_", "num_sample_frames_", "num_latent_frames_")
"""Instance attributes (prefixes) that shape a decode besides the config (tiles, HunyuanVideo's and LTX's frame
batching), read from the VAE object: a VAE whose tiles ``enable_tiling(...)`` set is planned with those tiles."""


@dataclass(frozen=True)
class DecodePeak:
    """The device bytes of one `vae.decode` call, in parts."""

    activation_nbytes: int
    """The most bytes of tensors the decode allocates that are alive at once, its output included."""
    latent_nbytes: int
    """The latents decoded, held on the device for the whole call."""
    weight_nbytes: int
    """The VAE's own weights and buffers in the decode's dtype: not in `nbytes`; the planner counts them once."""
    latent_shape: tuple[int, ...]
    """The latents' shape: (batch, channels, height, width), or (batch, channels, frames, height, width)."""
    tiled: bool
    """Whether the decode was planned tiled (diffusers tiles only latents larger than one tile)."""
    sliced: bool
    """Whether a batch was planned decoded one sample at a time."""
    flops: int = 0
    """The decode's work: its convolutions' FLOPs, two per multiply-add (the rest of a VAE is a few percent)."""

    @property
    def nbytes(self) -> int:
        """The decode's device peak beyond the VAE's weights."""
        return self.activation_nbytes + self.latent_nbytes


def estimate_decode_peak(
    vae: nn.Module,
    *,
    height: int,
    width: int,
    num_frames: int | None,
    batch: int = 1,
    tiled: bool,
    dtype: torch.dtype,
    sliced: bool = False,
    device_type: DeviceType = "cuda",
) -> DecodePeak:
    """The device bytes of `vae.decode` (a loaded VAE or a meta-device skeleton) for an output of `height` x
    `width` (x `num_frames` for a video VAE), a batch of `batch`, tiled or not, `sliced` or not, in `dtype` on a
    device of `device_type` (whose convolutions' scratch is counted: `conv_scratch`)."""
    shape = latent_shape(vae, height=height, width=width, num_frames=num_frames, batch=batch)
    key = _VaeKey.of(vae, dtype)
    threads = torch.get_num_threads() if device_type == "cpu" else 0  # the CPU's kernel choice reads it
    activation_nbytes, flops = _traced_peak(key, shape, tiled, sliced, device_type, threads)
    return DecodePeak(
        activation_nbytes=activation_nbytes,
        latent_nbytes=math.prod(shape) * dtype.itemsize,
        weight_nbytes=sum(t.numel() for t in (*vae.parameters(), *vae.buffers())) * dtype.itemsize,
        latent_shape=shape,
        tiled=tiled,
        sliced=sliced,
        flops=flops,
    )


def latent_shape(
    vae: nn.Module, *, height: int, width: int, num_frames: int | None, batch: int = 1
) -> tuple[int, ...]:
    """The shape of the latents `vae.decode` takes for that output (a video VAE decodes 5-D latents; an image
    made by one, as Qwen-Image does, is one frame)."""
    config = vae.config
    channels = _config_int(config, "z_dim", "latent_channels")
    spatial = vae_spatial_compression(vae)
    if height % spatial or width % spatial:
        raise ValueError(f"height and width must be multiples of the VAE's {spatial}x compression, got {height}x{width}")
    if not decodes_video(vae):
        if num_frames not in (None, 1):
            raise ValueError(f"{type(vae).__name__} decodes images; num_frames must be None, got {num_frames}")
        return (batch, channels, height // spatial, width // spatial)
    temporal = vae_temporal_compression(vae)
    frames = 1 if num_frames is None else (num_frames - 1) // temporal + 1
    return (batch, channels, frames, height // spatial, width // spatial)


def decodes_video(vae: nn.Module) -> bool:
    """Whether the VAE's decoder takes 5-D latents (it holds 3-D convolutions)."""
    decoder = getattr(vae, "decoder", vae)
    return any(isinstance(m, nn.Conv3d) for m in decoder.modules())


def vae_spatial_compression(vae: nn.Module) -> int:
    """Output pixels per latent along height and width."""
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if isinstance(ratio, int) and ratio > 0:
        return ratio
    return 2 ** (len(vae.config.block_out_channels) - 1)  # AutoencoderKL: one halving per level but the last


def vae_temporal_compression(vae: nn.Module) -> int:
    """Output frames per latent frame after the first (a causal video VAE decodes the first frame alone)."""
    for value in (getattr(vae, "temporal_compression_ratio", None), getattr(vae.config, "scale_factor_temporal", None)):
        if isinstance(value, int) and value > 0:
            return value
    downsample = getattr(vae.config, "temperal_downsample", None)  # Wan's spelling
    return 2 ** sum(bool(d) for d in downsample) if downsample else 1


def _config_int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"the VAE's config has none of {', '.join(names)}: cannot size its latents")


@dataclass(frozen=True)
class _VaeKey:
    """What a traced decode depends on (hashable, so equal VAEs share one trace)."""

    vae_class: type
    config_json: str
    attributes: tuple[tuple[str, Any], ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, vae: nn.Module, dtype: torch.dtype) -> _VaeKey:
        attributes = tuple(
            sorted(
                (name, value)
                for name, value in vars(vae).items()
                if name.startswith(_TILING_ATTRIBUTES) and isinstance(value, (bool, int, float))
            )
        )
        config_json = json.dumps(dict(vae.config), sort_keys=True, default=str)
        return cls(type(vae), config_json, attributes, dtype)

    def build_meta(self) -> nn.Module:
        with torch.device("meta"):
            vae = self.vae_class.from_config(json.loads(self.config_json))
        vae = vae.to(self.dtype).eval()
        for name, value in self.attributes:
            setattr(vae, name, value)
        return vae


@functools.lru_cache(maxsize=256)
def _traced_peak(
    key: _VaeKey, shape: tuple[int, ...], tiled: bool, sliced: bool, device_type: DeviceType, threads: int
) -> tuple[int, int]:
    """(the decode's peak bytes, its FLOPs)."""
    vae = key.build_meta()
    vae.use_tiling = tiled
    vae.use_slicing = sliced
    latents = torch.empty(shape, dtype=key.dtype, device="meta")
    # the decoder (and the 1x1 convolution before it) run once per latent frame and tile: replayed, not rerun
    replayed = [m for m in (vae.decoder, getattr(vae, "post_quant_conv", None)) if isinstance(m, nn.Module)]
    traced = trace_call(lambda: vae.decode(latents, return_dict=False), replayed=replayed, device_type=device_type)
    return traced.peak_nbytes, traced.flops
