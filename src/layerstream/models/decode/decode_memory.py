"""The VAE decode of one pipeline call: the device memory left for it, its planned peaks, and how it runs
(tiled or not, a batch whole or one sample at a time), chosen before the first denoising step.

Device memory left: on CUDA, what the driver reports free plus what torch's caching allocator holds unused
(the decode reuses it); with ``device_memory_gb`` set (the CPU stand-in, or a smaller card simulated on a large
one), that figure minus what the runtime holds on the device: every module's resident tensors and the slot ring.
A VAE that is not on the device before it decodes (module mode swaps it in) adds its weights to the decode's peak.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerstream.config.offload_config import OffloadConfig
from layerstream.models.generation_size import GenerationSize
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
    pipeline: Any, settings: VaeDecodeSettings, request: GenerationSize, device: torch.device, stats: OffloadStats | None
) -> VaeDecodeChoice | None:
    """How the pipeline's VAE will decode `request` (None: the pipeline has no VAE that can tile)."""
    vae = getattr(pipeline, "vae", None)
    # diffusers' AutoencoderMixin gives every VAE enable_tiling(), which raises where the VAE has no use_tiling
    if not isinstance(vae, nn.Module) or not hasattr(vae, "use_tiling"):
        return None
    if device.type == "cuda" and device.index is None:  # tensors name their index: "cuda" alone matches none
        device = torch.device("cuda", torch.cuda.current_device())
    peaks = _Peaks(vae, request, device)
    free = free_decode_nbytes(pipeline, device, settings.device_memory_gb, stats)
    return choose_vae_decode(settings.vae_use_tiling, settings.vae_use_slicing, peaks, free)


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


class _Peaks(Mapping):
    """(tiled, sliced) -> the decode's planned peak, estimated when first asked for (a tiled trace of a long
    video takes a second or two; the choice usually stops at the untiled one). A VAE without slicing has no
    sliced ways; a batch of one decodes sliced as whole (the same peak); a peak that cannot be estimated (a VAE
    the trace cannot run) is None."""

    def __init__(self, vae: nn.Module, request: GenerationSize, device: torch.device) -> None:
        self._vae, self._request = vae, request
        self._device_type = "cpu" if device.type == "cpu" else "cuda"  # whose convolution scratch to count
        # a VAE that is not on the device now (module mode swaps it in to decode) brings its weights with it
        self._brings_weights = device.type != "cpu" and device_bytes(vae, device) == 0
        slices = (False, True) if hasattr(vae, "use_slicing") else (False,)
        self._keys = [(t, s) for t in (False, True) for s in slices]
        self._known: dict[tuple[bool, bool], int | None] = {}

    def __contains__(self, key: object) -> bool:  # Mapping's would estimate the peak to answer
        return key in self._keys

    def __getitem__(self, key: tuple[bool, bool]) -> int | None:
        if key not in self._keys:
            raise KeyError(key)
        tiled, sliced = key
        sliced = sliced and self._request.batch > 1  # slicing a batch of one changes nothing
        if (tiled, sliced) not in self._known:
            self._known[(tiled, sliced)] = self._estimate(tiled, sliced)
        return self._known[(tiled, sliced)]

    def __iter__(self) -> Iterator[tuple[bool, bool]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def _estimate(self, tiled: bool, sliced: bool) -> int | None:
        from layerstream.models.decode.vae_decode import estimate_decode_peak

        r = self._request
        if r.height is None or r.width is None:
            return None  # the pipeline picks its size: nothing to plan from
        try:
            peak = estimate_decode_peak(
                self._vae, height=r.height, width=r.width, num_frames=r.num_frames, batch=r.batch,
                tiled=tiled, sliced=sliced, dtype=self._vae.dtype, device_type=self._device_type,
            )  # fmt: skip
            return peak.nbytes + (peak.weight_nbytes if self._brings_weights else 0)
        except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as e:
            logger.info("the decode of %s cannot be planned: %s: %s", type(self._vae).__name__, type(e).__name__, e)
            return None
