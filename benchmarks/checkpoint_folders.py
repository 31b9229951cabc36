"""Real-width diffusers checkpoint folders with few blocks, written from random weights, for cold-start
measurements (`cold_start.py`, `lossless.py`) and the tests that load a real-width checkpoint.

A `CheckpointSpec` names a Wan 2.2 pipeline (two experts, `WanTransformer3DModel`) or a Flux pipeline
(`FluxTransformer2DModel`) at a given transformer width and block count; everything but the transformers is
layerstream's tiny components (text encoders and VAEs of a few KB), so the checkpoint's bytes are the
transformers'. Weights are saved in bfloat16, as the released checkpoints are. The folder layout is exactly
what `save_pretrained` writes, so every loader (diffusers, layerstream) reads it as it would a downloaded model.

`cached_checkpoint_folder` writes a folder once under a cache folder and reuses it afterwards (published
atomically: a folder is either complete or absent). Building imports diffusers; nothing happens at import time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from layerstream.models.cache import cache_root, publish_folder

SPEC_FILE = "checkpoint_spec.json"
"""Written last into every folder this module builds (the marker of a complete build)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """One pipeline folder to write: the transformer's width and how many blocks it has."""

    family: Literal["wan", "flux"]
    num_heads: int
    head_dim: int
    num_blocks: int
    """Wan: blocks per expert; Flux: double-stream blocks."""
    ffn_dim: int = 0
    """Wan only (Flux's MLP is 4x its width)."""
    num_single_blocks: int = 0
    """Flux only: single-stream blocks."""
    num_experts: int = 2
    """Wan only: 2 writes a Wan 2.2 pipeline (`transformer` and `transformer_2`), 1 a Wan 2.1 one."""
    max_shard_size: str | None = None
    """`save_pretrained`'s shard size (None: diffusers' default, one file per transformer at these sizes)."""

    def __post_init__(self):
        if self.family not in ("wan", "flux"):
            raise ValueError(f"family = {self.family!r}; expected 'wan' or 'flux'")
        if self.family == "wan" and (self.ffn_dim <= 0 or self.num_experts not in (1, 2)):
            raise ValueError(f"a Wan spec needs ffn_dim > 0 and num_experts 1 or 2, got {self}")
        if min(self.num_heads, self.head_dim, self.num_blocks) <= 0:
            raise ValueError(f"num_heads, head_dim and num_blocks must be positive, got {self}")

    @property
    def folder_name(self) -> str:
        """A name that changes whenever the spec does, so that a cached folder always matches its spec."""
        width = f"{self.num_heads}x{self.head_dim}"
        if self.family == "wan":
            name = f"wan-{width}-ffn{self.ffn_dim}-{self.num_experts}x{self.num_blocks}blocks"
        else:
            name = f"flux-{width}-{self.num_blocks}+{self.num_single_blocks}blocks"
        return name + (f"-shard{self.max_shard_size}" if self.max_shard_size else "")


WAN_1_3B_WIDTH = CheckpointSpec(family="wan", num_heads=12, head_dim=128, ffn_dim=8960, num_blocks=6)
"""Wan 2.2 with Wan 1.3B's width (12 heads of 128, FFN 8960): 6 blocks per expert, about 1.2 GB in bfloat16."""
FLUX_WIDTH = CheckpointSpec(family="flux", num_heads=24, head_dim=128, num_blocks=1, num_single_blocks=2)
"""Flux.1's width (24 heads of 128): one double- and two single-stream blocks, about 1.3 GB in bfloat16."""
SMALL_WAN = CheckpointSpec(family="wan", num_heads=2, head_dim=64, ffn_dim=256, num_blocks=2)
SMALL_FLUX = CheckpointSpec(family="flux", num_heads=2, head_dim=64, num_blocks=1, num_single_blocks=1)
"""The small ones (--smoke): seconds to write, a few MB."""


def wan_transformer(spec: CheckpointSpec, *, seed: int):
    """A `WanTransformer3DModel` of the spec's width, random weights under `seed`, in bfloat16."""
    from diffusers import WanTransformer3DModel

    from layerstream.models.tiny_components import LATENT_CHANNELS, TEXT_HIDDEN_SIZE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
            in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_HIDDEN_SIZE, freq_dim=256,
            ffn_dim=spec.ffn_dim, num_layers=spec.num_blocks, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        ).to(torch.bfloat16)  # fmt: skip


def flux_transformer(spec: CheckpointSpec, *, seed: int):
    """A `FluxTransformer2DModel` of the spec's width, random weights under `seed`, in bfloat16."""
    from diffusers import FluxTransformer2DModel

    from layerstream.models.tiny_components import LATENT_CHANNELS, TEXT_HIDDEN_SIZE

    # rotary axes: an even split of the head dim (Flux.1 uses 16, 56, 56 of 128)
    side = (spec.head_dim - 16) // 2 // 2 * 2
    axes = (spec.head_dim - 2 * side, side, side)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FluxTransformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=spec.num_blocks,
            num_single_layers=spec.num_single_blocks, attention_head_dim=spec.head_dim,
            num_attention_heads=spec.num_heads, joint_attention_dim=TEXT_HIDDEN_SIZE,
            pooled_projection_dim=TEXT_HIDDEN_SIZE, guidance_embeds=True, axes_dims_rope=axes,
        ).to(torch.bfloat16)  # fmt: skip


def write_checkpoint_folder(spec: CheckpointSpec, folder: Path) -> Path:
    """Write the spec's pipeline into `folder` with `save_pretrained` (safetensors), then `SPEC_FILE`."""
    save_kwargs = {"safe_serialization": True}
    if spec.max_shard_size:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    if spec.family == "wan":
        from diffusers import WanPipeline

        from layerstream.models.tiny_components import build_wan_components

        components = build_wan_components()
        components["transformer"] = wan_transformer(spec, seed=2)
        if spec.num_experts == 2:
            components["transformer_2"] = wan_transformer(spec, seed=3)
        else:
            components["transformer_2"] = None
            components["boundary_ratio"] = None
        WanPipeline(**components).save_pretrained(folder, **save_kwargs)
    else:
        from diffusers import FluxPipeline

        from layerstream.models.tiny_components import build_flux_components

        components = build_flux_components()
        components["transformer"] = flux_transformer(spec, seed=13)
        FluxPipeline(**components).save_pretrained(folder, **save_kwargs)
    (folder / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return folder


def default_cold_start_dir() -> Path:
    return cache_root() / "bench" / "cold-start"


def cached_checkpoint_folder(spec: CheckpointSpec, root: Path | None = None) -> tuple[Path, bool]:
    """The spec's folder under `root` (default `default_cold_start_dir()`), written if it is not there yet.
    Returns (folder, whether this call wrote it)."""
    folder = (root if root is not None else default_cold_start_dir()) / spec.folder_name
    built = publish_folder(folder, lambda build: write_checkpoint_folder(spec, build), marker=SPEC_FILE)
    return folder, built


def checkpoint_files(folder: Path) -> list[Path]:
    """Every safetensors file of a pipeline folder, in a fixed order."""
    return sorted(folder.glob("*/*.safetensors"))
