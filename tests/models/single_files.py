"""Tiny single-file checkpoints in the layouts published files have: GGUF written by the `gguf` package's writer
(its quantizers for Q8_0 and Q4_0, valid K-quant super-blocks built by hand), with Wan's original key names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# diffusers' Wan names -> the original checkpoint's (as published GGUF files of Wan 2.x spell them), applied in order
_WAN_ORIGINAL_NAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
    ("proj_out", "head.head"),
)


def wan_original_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` of a diffusers Wan transformer under the original checkpoint's names."""
    out = {}
    for key, value in state_dict.items():
        for new, old in _WAN_ORIGINAL_NAMES:
            key = key.replace(new, old)
        if key == "scale_shift_table":
            key = "head.modulation"
        out[key.replace(".scale_shift_table", ".modulation")] = value
    return out


# bytes per 256-value super-block, and where its fp16 scale(s) sit: (offset of d, offset of dmin or None)
_K_BLOCKS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None)}


def _k_quant_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks with small finite scales (any quants and sub-scales are valid bytes)."""
    size, d_at, dmin_at = _K_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    blocks[:, :, d_at : d_at + 2] = np.array([0.002], dtype=np.float16).view(np.uint8)
    if dmin_at is not None:
        blocks[:, :, dmin_at : dmin_at + 2] = np.array([0.001], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, state_dict: dict[str, torch.Tensor], kinds: dict[str, str], *, arch: str = "wan") -> dict[str, str]:
    """`state_dict` as a GGUF file: each 2-D block weight (``blocks.`` in its name) in the first type of `kinds`
    (pattern -> type name, the pattern a substring of the key; "" matches all) whose rows it fits, the rest
    float32. Returns key -> type written, for the quantized ones."""
    import gguf

    quant = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    written = {}
    for key, value in state_dict.items():
        array = value.float().numpy()
        kind = next((k for pattern, k in kinds.items() if pattern in key), None)
        block = 256 if kind in _K_BLOCKS else 32
        if kind and "blocks." in key and key.endswith(".weight") and array.ndim == 2 and array.shape[1] % block == 0:
            if kind in _K_BLOCKS:
                data = _k_quant_blocks(*array.shape, kind, rng)
            else:
                data = gguf.quants.quantize(array, quant[kind])
            writer.add_tensor(key, data, raw_shape=data.shape, raw_dtype=quant[kind])
            written[key] = kind
        else:
            writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as stored (quantized ones as their block bytes), by the file's names."""
    import gguf

    return {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def write_fp8_scaled(
    path: Path, state_dict: dict[str, torch.Tensor], *, spelling: str | None, original_names: bool
) -> dict[str, torch.Tensor]:
    """`state_dict` (diffusers names) as an fp8_scaled safetensors file in a published layout: each 2-D block weight
    float8 (e4m3) with a per-tensor scale; ``spelling="scale_weight"``: the older layout (the ``scaled_fp8`` marker,
    ``<layer>.scale_weight`` and ``<layer>.scale_input`` of shape [1]); ``"weight_scale"``: the newer one
    (``<layer>.weight_scale`` and ``<layer>.input_scale``, 0-dim); None: a plain float8 cast, no scale and no
    marker (the ``fp8_e4m3fn`` files published for ComfyUI). Returns the reference: the state dict with each
    float8 weight upcast as ``weight.to(float32) * scale`` (a scale of 1 for a plain cast)."""
    from safetensors.torch import save_file

    out, reference = {}, dict(state_dict)
    shape = (1,) if spelling == "scale_weight" else ()
    for key, value in state_dict.items():
        if "blocks." in key and key.endswith(".weight") and value.ndim == 2:
            scale = value.abs().amax().float() / 448.0 if spelling else torch.tensor(1.0)
            weight = (value.float() / scale).to(torch.float8_e4m3fn)
            layer = key.removesuffix(".weight")
            out[key] = weight
            if spelling:
                out[f"{layer}.{spelling}"] = scale.reshape(shape)
                out[f"{layer}.{'scale_input' if spelling == 'scale_weight' else 'input_scale'}"] = torch.ones(shape)
            reference[key] = weight.to(torch.float32) * scale.to(torch.float32)
        else:
            out[key] = value.contiguous()
    if spelling == "scale_weight":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    if original_names:
        out = {k if k == "scaled_fp8" else next(iter(wan_original_keys({k: None}))): v for k, v in out.items()}
    save_file(out, str(path))
    return reference
