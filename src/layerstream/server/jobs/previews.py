"""Previews of a running job, drawn cheaply from its latents with a linear latent-to-RGB projection.
The projection is fitted once from the model's own VAE: random latents of a small grid are decoded, pooled
down, and least squares gives per colour a weight per channel and a bias. A preview is then one small matrix
product, a pixel per latent position (a 1280x720 Wan video: 160x90). The latents are copied, and the fit
draws its noise from its own generator: the generation is untouched."""

from __future__ import annotations

import base64
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

PACKED_PIPELINES = frozenset({
    "FluxPipeline", "FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
    "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageImg2ImgPipeline",
})  # fmt: skip
"""Pipelines whose latents are 2x2 patches packed into tokens, [batch, (h/2)(w/2), channels x 4]."""
FIT_GRID = 16  # latent positions per side of the fit: 256 samples for (channels + 1) unknowns per colour


@dataclass(frozen=True)
class LatentProjection:
    """rgb (in [-1, 1]) = latents . weight + bias, per latent position."""

    weight: torch.Tensor  # [channels, 3]
    bias: torch.Tensor  # [3]
    packed: bool
    vae_scale: int  # pixels per latent position along each side

    def preview_data_url(self, latents: torch.Tensor, *, width: int, height: int) -> str:
        """A PNG data URL of the first output's latents (a video's middle frame), a pixel per latent position."""
        grid = latent_grid(latents[:1], packed=self.packed, width=width, height=height, vae_scale=self.vae_scale)[0]
        if grid.ndim == 4:  # [channels, frames, h, w]
            grid = grid[:, grid.shape[1] // 2]
        rgb = torch.einsum("chw,cr->hwr", grid, self.weight) + self.bias
        pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def latent_grid(latents: torch.Tensor, *, packed: bool, width: int, height: int, vae_scale: int) -> torch.Tensor:
    """The latents as a float32 CPU grid, [batch, channels, (frames,) h, w]."""
    # a copy off the device: the generation keeps its own tensor untouched (on a GPU this waits for the step)
    latents = latents.detach().to("cpu", torch.float32)
    if not packed:
        return latents
    h, w = 2 * (height // (vae_scale * 2)), 2 * (width // (vae_scale * 2))
    batch, _, features = latents.shape
    channels = features // 4
    grid = latents.view(batch, h // 2, w // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(batch, channels, h, w)


def fit_latent_projection(pipeline: Any) -> LatentProjection | None:
    """The projection for `pipeline`'s latents, fitted from its VAE; None (logged) where it cannot be."""
    vae = getattr(pipeline, "vae", None)
    if vae is None:
        logger.info("previews: %s has no VAE; no previews", type(pipeline).__name__)
        return None
    try:
        return _fit(pipeline, vae)
    except Exception as e:  # an unusual VAE: previews are an extra, the server runs without them
        logger.warning("previews: no latent projection for %s (%s: %s)", type(pipeline).__name__, type(e).__name__, e)
        return None


def _fit(pipeline: Any, vae: Any) -> LatentProjection:
    config = vae.config
    # Wan-style VAEs normalize per channel; others (AutoencoderKL) leave these None and scale as a whole
    per_channel = config.get("latents_mean") is not None and config.get("latents_std") is not None
    channels = config.get("z_dim") or config.get("latent_channels")
    vae_scale = int(getattr(pipeline, "vae_scale_factor_spatial", None) or pipeline.vae_scale_factor)
    generator = torch.Generator("cpu").manual_seed(0)  # its own: the global generator is left as it was
    shape = (1, channels, 1, FIT_GRID, FIT_GRID) if per_channel else (1, channels, FIT_GRID, FIT_GRID)
    latents = torch.randn(shape, generator=generator)
    if per_channel:  # the pipeline's latents are normalized per channel; the VAE takes them back
        mean = torch.tensor(config["latents_mean"]).view(1, channels, 1, 1, 1)
        std = torch.tensor(config["latents_std"]).view(1, channels, 1, 1, 1)
        vae_latents = latents * std + mean
    else:
        vae_latents = latents / config.get("scaling_factor", 1.0) + (config.get("shift_factor") or 0.0)
    parameter = next(vae.parameters())
    with torch.inference_mode():
        decoded = vae.decode(vae_latents.to(parameter.device, parameter.dtype), return_dict=False)[0]
    decoded = decoded.to("cpu", torch.float32)
    if decoded.ndim == 5:
        decoded, latents = decoded[:, :, 0], latents[:, :, 0]
    pooled = torch.nn.functional.adaptive_avg_pool2d(decoded, (FIT_GRID, FIT_GRID))
    inputs = torch.cat([latents[0].flatten(1).T, torch.ones(FIT_GRID * FIT_GRID, 1)], dim=1)  # [positions, c + 1]
    targets = pooled[0].flatten(1).T  # [positions, 3]
    solution = torch.linalg.lstsq(inputs, targets).solution
    packed = type(pipeline).__name__ in PACKED_PIPELINES
    return LatentProjection(weight=solution[:-1], bias=solution[-1], packed=packed, vae_scale=vae_scale)
