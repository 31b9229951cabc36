"""How far float8 storage moves a pipeline's output (`layerstream bench MODEL`): per storage, the bytes over the
link, the PSNR of the uint8 output and the largest difference of the final latents, against full precision
(tiny models have random weights: their PSNR only says that the path works)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FLOAT8_STORAGE = ("float8_e4m3fn", "float8_e5m2")


@dataclass
class QualityRow:
    storage: str
    """"full precision" or a float8 storage dtype."""
    bytes_transferred: int
    bytes_ratio: float
    psnr_db: float
    max_abs_latent_diff: float
    seconds: float


@dataclass
class QualityResult:
    model: str
    request: dict[str, Any]
    rows: list[QualityRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "request": self.request,
            "rows": [vars(r) | {"psnr_db": "inf" if math.isinf(r.psnr_db) else r.psnr_db} for r in self.rows],
        }

    def to_markdown(self) -> str:
        lines = [
            f"**{self.model}**, {', '.join(f'{k}={v}' for k, v in self.request.items())}",
            "",
            "| storage | link bytes / generation | x full precision | PSNR of the output | max abs latent diff | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            psnr = "identical" if math.isinf(r.psnr_db) else f"{r.psnr_db:.1f} dB"
            lines.append(
                f"| {r.storage} | {r.bytes_transferred / 1e6:.1f} MB | {r.bytes_ratio:.2f} | {psnr} | "
                f"{r.max_abs_latent_diff:.3g} | {r.seconds:.1f} |"
            )
        return "\n".join(lines) + "\n"


def psnr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """PSNR of uint8 pictures in dB (inf when identical)."""
    if reference.shape != other.shape:
        raise ValueError(f"cannot compare outputs of shapes {reference.shape} and {other.shape}")
    mse = float(np.mean((reference.astype(np.float64) - other.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def measure_quality(
    model: str,
    *,
    storages: tuple[str, ...] = FLOAT8_STORAGE,
    device: torch.device | str | None = None,
    dtype: str | None = None,
    request: dict[str, Any] | None = None,
) -> QualityResult:
    """Generate `request` with full-precision storage, then with each float8 `storages`, and compare."""
    from layerstream import Omni

    unknown = [s for s in storages if s not in FLOAT8_STORAGE]
    if unknown:
        raise ValueError(f"storage = {unknown[0]!r} is not valid; allowed: {', '.join(FLOAT8_STORAGE)}")
    request = dict(request or {"prompt": "a red fox in the snow", "num_inference_steps": 4, "seed": 0})
    result = QualityResult(model=model, request=request)
    reference: tuple[np.ndarray, torch.Tensor] | None = None
    full_bytes = 0
    for storage in ("full precision", *storages):
        options = {} if storage == "full precision" else {"storage_dtype": storage}
        config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}}
        omni = Omni(model=model, diffusion_offload_config=config, device=device, dtype=dtype)
        try:
            latents = _capture_decoder_input(omni.pipeline)
            out = omni.generate(**request)
        finally:
            omni.close()
        frames, final = out.frames, latents[-1].float()
        if reference is None:
            reference, full_bytes = (frames, final), out.stats.bytes_transferred
        result.rows.append(
            QualityRow(
                storage=storage,
                bytes_transferred=out.stats.bytes_transferred,
                bytes_ratio=out.stats.bytes_transferred / full_bytes if full_bytes else float("nan"),
                psnr_db=psnr_db(reference[0], frames),
                max_abs_latent_diff=float((final - reference[1]).abs().max()),
                seconds=out.stats.seconds,
            )
        )
    return result


def _capture_decoder_input(pipeline) -> list[torch.Tensor]:
    """Record what the pipeline's VAE decodes (the final latents) on this pipeline object."""
    vae = getattr(pipeline, "vae", None)
    if vae is None or not hasattr(vae, "decode"):
        raise ValueError(f"{type(pipeline).__name__} has no VAE to decode with; the quality bench needs one")
    seen: list[torch.Tensor] = []
    decode = vae.decode

    def recording_decode(z, *args, **kwargs):
        seen.append(z.detach().to("cpu", copy=True))
        return decode(z, *args, **kwargs)

    vae.decode = recording_decode  # on this instance only; the pipeline is closed right after
    return seen
