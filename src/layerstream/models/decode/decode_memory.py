"""How one pipeline call's VAE decode runs (tiled or not, a batch whole or one sample at a time), chosen before
the first denoising step from its planned peaks and the device memory left: on CUDA, what the driver reports free
plus what torch's caching allocator holds unused (the decode reuses it); with ``device_memory_gb`` (the CPU
stand-in, or a smaller card simulated on a large one), that figure minus the runtime's resident tensors and slots.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerstream.config.offload_config import OffloadConfig
from layerstream.models.size import GenerationSize
from layerstream.models.decode.vae_tiling import AUTO, VaeDecodeChoice, VaeSetting, choose_vae_decode
from layerstream.runtime.packing.tensors import device_bytes
from layerstream.runtime.reporting.stats import OffloadStats
from layerstream.wording import GB

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class VaeDecodeSettings:
    """How a runner decides its decodes (from `OffloadConfig`'s keys of the same names)."""

    vae_use_tiling: VaeSetting = AUTO
    vae_use_slicing: VaeSetting = AUTO
    device_memory_gb: float | None = None
    """The device's memory where it cannot be read (the CPU stand-in), or a smaller card on a larger one."""

    @classmethod
    def of(cls, config: OffloadConfig) -> VaeDecodeSettings:
        return cls(
            vae_use_tiling=config.vae_use_tiling, vae_use_slicing=config.vae_use_slicing,
            device_memory_gb=config.device_memory_gb,
        )  # fmt: skip


def choose_decode(
    pipeline: Any, settings: VaeDecodeSettings, request: GenerationSize, device: torch.device,
    stats: OffloadStats | None,
) -> VaeDecodeChoice | None:  # fmt: skip
    """How the pipeline's VAE will decode `request` (None: the pipeline has no VAE that can tile)."""
    vae = getattr(pipeline, "vae", None)
    # diffusers' AutoencoderMixin gives every VAE enable_tiling(), which raises where the VAE has no use_tiling
    if not isinstance(vae, nn.Module) or not hasattr(vae, "use_tiling"):
        return None
    if device.type == "cuda" and device.index is None:  # tensors name their index: "cuda" alone matches none
        device = torch.device("cuda", torch.cuda.current_device())
    slicings = (False, True) if hasattr(vae, "use_slicing") else (False,)
    ways = [(tiled, sliced) for tiled in (False, True) for sliced in slicings]
    # each peak estimated when first asked for (a tiled trace of a long video takes a second or two; the choice
    # usually stops at the untiled one)
    planned = functools.cache(functools.partial(_planned_peak, vae, request, device))

    def peak_of(way: tuple[bool, bool]) -> int | None:  # a batch of one decodes sliced as whole: one trace for both
        return planned((way[0], way[1] and request.batch > 1))

    free = free_decode_nbytes(pipeline, device, settings.device_memory_gb, stats)
    return choose_vae_decode(settings.vae_use_tiling, settings.vae_use_slicing, ways, peak_of, free)


def free_decode_nbytes(pipeline: Any, device: torch.device, device_memory_gb: float | None, stats: OffloadStats | None) -> int | None:
    """Device memory left for the decode (module docstring); None where there is none to read."""
    figures = []
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        figures.append(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device_memory_gb is not None:
        figures.append(round(device_memory_gb * GB) - held_on_device(pipeline, device, stats))
    return max(0, min(figures)) if figures else None


def held_on_device(pipeline: Any, device: torch.device, stats: OffloadStats | None) -> int:
    """What the runtime holds on `device`: the modules' resident tensors (streamed blocks out of their slots
    count nothing) and the slot ring."""
    components = getattr(pipeline, "components", {}) or {}
    modules = [m for m in components.values() if isinstance(m, nn.Module)]
    return sum(device_bytes(m, device) for m in modules) + (stats.slot_bytes if stats is not None else 0)


def _planned_peak(vae: nn.Module, request: GenerationSize, device: torch.device, way: tuple[bool, bool]) -> int | None:
    """The planned peak of decoding `request` `way` = (tiled, sliced); a VAE that is not on the device now (module
    mode swaps it in to decode) brings its weights with it. None where it cannot be estimated: the pipeline picks
    its size, or the trace cannot run the VAE."""
    from layerstream.models.decode.vae_decode import estimate_decode_peak

    if request.height is None or request.width is None:
        return None
    try:
        peak = estimate_decode_peak(
            vae, height=request.height, width=request.width, num_frames=request.num_frames, batch=request.batch,
            tiled=way[0], sliced=way[1], dtype=vae.dtype,
            device_type="cpu" if device.type == "cpu" else "cuda",  # whose convolution scratch to count
        )  # fmt: skip
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as e:
        logger.info("the decode of %s cannot be planned: %s: %s", type(vae).__name__, type(e).__name__, e)
        return None
    brings_weights = device.type != "cpu" and device_bytes(vae, device) == 0
    return peak.nbytes + (peak.weight_nbytes if brings_weights else 0)
