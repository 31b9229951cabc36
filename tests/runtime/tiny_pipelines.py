"""The embedded tiny Wan 2.2 and Flux pipelines for the runtime tests: loading, one short generation, and a LoRA
file written by the test itself (PEFT's state dict saved with safetensors; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("wan", "flux")
_NAMES = {"wan": "tiny-wan", "flux": "tiny-flux"}
_CALL = {
    # two steps at the smallest size each VAE and patch size allow: latents are compared, not decoded
    "wan": dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=4.0),
    "flux": dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5),
}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""Attention projections: every tiny DiT block (Wan and Flux, double and single) has them."""
DIT = {"mode": "layer", "components": ["dit"]}


def load(kind: str):
    """A freshly loaded tiny pipeline (built once per test session, then loaded from the session cache)."""
    from layerstream.models.loading import load_pipeline

    pipe = load_pipeline(_NAMES[kind])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_wan(source: str):
    """The tiny Wan 2.2 pipeline: as loaded from its folder (`"checkpoint"`: its DiT weights are lazy views of
    the safetensors files), or with both experts' weights copied into memory (`"in-memory"`). The two are
    different resident models on some CPUs: a copy starts 64-byte aligned where the view kept the file's offset,
    and MKL's matrix-vector product rounds by alignment (AMD EPYC), so compare each with its own kind."""
    pipe = load("wan")
    if source == "in-memory":
        with torch.no_grad():
            for m in (pipe.transformer, pipe.transformer_2):
                for p in m.parameters():
                    p.data = p.data.clone()
    return pipe


def generate(pipe, kind: str, **overrides) -> torch.Tensor:
    """Latents of one short, seeded generation."""
    kwargs = {**_CALL[kind], **overrides}
    kwargs.setdefault("output_type", "latent")
    out = pipe("a red fox in the snow", generator=torch.Generator().manual_seed(0), **kwargs)
    return (out.frames if kind == "wan" else out.images).clone()


def dit_components(pipe) -> list[str]:
    return [name for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None]


def write_lora_file(pipe, folder: Path, *, seed: int, rank: int = 4) -> Path:
    """A diffusers-format LoRA for every DiT of `pipe`, with random (non-zero) A and B, saved with safetensors.
    `pipe` is left unchanged (the adapter is added to a copy of each DiT's config-built twin)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = {}
    for name in dit_components(pipe):
        model = type(getattr(pipe, name)).from_config(getattr(pipe, name).config)
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, init_lora_weights=False))
        for key, value in get_peft_model_state_dict(model).items():
            tensors[f"{name}.{key}"] = value.contiguous() * 0.1
    path = folder / f"lora-{seed}.safetensors"
    save_file(tensors, str(path))
    return path
