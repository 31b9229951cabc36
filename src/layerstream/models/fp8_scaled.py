"""fp8_scaled safetensors single files (ComfyUI's "fp8_scaled" Wan 2.x, Flux and Qwen-Image files): float8 weights,
each with a per-tensor scale (``<layer>.scale_weight`` in older files, beside the marker ``scaled_fp8``;
``<layer>.weight_scale`` in newer ones), recognised from the header before anything loads. The activation scales
and per-layer notes only an fp8 matmul reads (``scale_input``, ``input_scale``, ``comfy_quant``) are left out; a key
that cannot be placed (a scale without its weight, a scale of more than one value, a float8 tensor without its
scale) is refused by name: such a file is never loaded as if unscaled. A file of float8 weights with no scale and
no marker at all is a plain cast (the ``fp8_e4m3fn`` files published for ComfyUI): each weight reads with a scale
of 1. The weights stay float8 on the host (a streamed block carries 1 byte a weight and its scales); each scaled
Linear computes with ``weight.to(compute) * scale.to(compute)`` in diffusers' layerwise-casting hook slot, the keys
renamed by diffusers' single-file converter (each scale following its weight)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from layerstream.models.folder_check import ModelLoadError
from layerstream.models.saved_dtypes import read_safetensors_header

FLOAT8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MARKER = "scaled_fp8"
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
"""A float8 weight ``<layer>.weight``'s per-tensor scale, as published files spell it."""
UNREAD_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
"""Activation scales (read by an fp8 matmul, not by an upcast) and ComfyUI's per-layer format notes."""


class Fp8LayoutError(ModelLoadError):
    """An fp8_scaled file whose layout is not recognised: one line naming the key."""


@dataclass(frozen=True)
class Fp8ScaledLayout:
    """Where an fp8_scaled file's weights and scales are, by key."""

    scales: dict[str, str]
    unread: tuple[str, ...]
    """The marker, activation scales and notes: not loaded."""
    unscaled: tuple[str, ...] = ()
    """The weights of a plain float8 file (no scale, no marker): each computed with a scale of 1."""


def is_float8_file(path: Path) -> bool:
    """Whether the safetensors file at `path` holds a float8 tensor or an fp8_scaled marker (its header alone)."""
    header = read_safetensors_header(path)
    return any(
        k.rpartition(".")[2] == MARKER or (isinstance(e, dict) and e.get("dtype") in FLOAT8_DTYPES) for k, e in header.items()
    )


def is_layout_key(key: str) -> bool:
    """Whether `key` is the marker, a scale or a note rather than a tensor of the model."""
    return key.rpartition(".")[2] == MARKER or key.endswith(SCALE_SUFFIXES + UNREAD_SUFFIXES)


def read_layout(name: str, file_name: str, header: dict) -> Fp8ScaledLayout:
    """The layout of an fp8_scaled file (its safetensors `header`), checked whole; errors name `file_name`."""
    where = f"component {name}: {file_name}"
    entries = {k: e for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)}
    scales: dict[str, str] = {}
    unread = []
    for key, entry in entries.items():
        if key.rpartition(".")[2] == MARKER or key.endswith(UNREAD_SUFFIXES):
            unread.append(key)
            continue
        suffix = next((s for s in SCALE_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        weight = key[: -len(suffix)] + ".weight"
        if entries.get(weight, {}).get("dtype") not in FLOAT8_DTYPES:
            raise Fp8LayoutError(f"{where}: scale {key} has no float8 weight {weight} beside it; the layout is not recognised")
        if weight in scales:
            raise Fp8LayoutError(f"{where}: weight {weight} has two scales, {scales[weight]} and {key}")
        if math.prod(entry.get("shape", [])) != 1:
            raise Fp8LayoutError(
                f"{where}: scale {key} holds {math.prod(entry.get('shape', []))} values; only per-tensor scales "
                "(one value) are read"
            )
        scales[weight] = key
    float8 = [k for k, e in entries.items() if e.get("dtype") in FLOAT8_DTYPES]
    unscaled = [k for k in float8 if k not in scales and k not in unread]
    if unscaled and (scales or unread):  # a scaled file: every float8 weight has its scale
        key = unscaled[0]
        spellings = " or ".join(key.removesuffix(".weight") + s for s in SCALE_SUFFIXES)
        raise Fp8LayoutError(f"{where}: float8 tensor {key} has no scale ({spellings}); not loaded as if unscaled")
    for key in (k for k in unscaled if not k.endswith(".weight")):  # a plain float8 cast: weights only
        raise Fp8LayoutError(f"{where}: float8 tensor {key} is not a weight; only Linear weights are read from float8")
    return Fp8ScaledLayout(scales, tuple(unread), tuple(unscaled))


def load_fp8_scaled(name: str, cls: type, path: Path, config_folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` (a `cls` configured by `config_folder`) from the fp8_scaled file at `path`: float8
    weights kept, every other floating tensor in `dtype` (but float32 for the class's `_keep_in_fp32_modules` when
    `dtype` is float16, as diffusers loads them), each scaled Linear computing in `dtype`."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    layout = read_layout(name, path.name, read_safetensors_header(path))
    skip = set(layout.unread) | set(layout.scales.values())
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in skip}
        scales = {w: f.get_tensor(s).reshape(()).float() for w, s in layout.scales.items()}
    scales.update({w: torch.tensor(1.0) for w in layout.unscaled})  # a plain cast: the weight as it is
    config = cls.load_config(config_folder)
    with init_empty_weights():
        model = cls.from_config(config)
    tensors, scales = _converted(name, cls, config, model.state_dict(), tensors, scales)
    # in float16, the modules the class keeps in float32 stay float32, as diffusers' own loading keeps them
    keep = (getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    tensors = {
        k: t if k in scales or not t.is_floating_point() else t.to(torch.float32 if any(m in k.split(".") for m in keep) else dtype)
        for k, t in tensors.items()
    }
    missing = [k for k in model.state_dict() if k not in tensors]
    unexpected = [k for k in tensors if k not in model.state_dict()]
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which the model does not"
        raise ModelLoadError(f"component {name}: {path.name} {what} (is it a file of this model, {cls.__name__}?)")
    model.load_state_dict(tensors, strict=True, assign=True)  # assign: float8 weights stay float8
    for key, scale in scales.items():
        apply_scaled_float8_(name, model.get_submodule(key.removesuffix(".weight")), key, scale, dtype)
    return model.eval()


def _converted(name, cls, config, wanted, tensors, scales):
    """(tensors, scales) under the model's names: converted by diffusers' single-file converter for `cls` where
    the names differ, each scale converted beside its weight as a view of the weight's shape (no bytes), so that
    a weight split by the converter keeps its scale on each part."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, _should_convert_state_dict_to_diffusers

    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__, {}).get("checkpoint_mapping_fn")
    if mapping is None or not _should_convert_state_dict_to_diffusers(wanted, tensors):
        return tensors, scales
    nan = torch.tensor(float("nan"))
    shadow = {k: scales.get(k, nan).expand(t.shape) for k, t in tensors.items()}
    converted = mapping(checkpoint=dict(tensors), config=config)
    converted_scales = {}
    for key, s in mapping(checkpoint=shadow, config=config).items():
        low, high = (s.reshape(-1)[0],) * 2 if all(st == 0 for st in s.stride()) else (s.amin(), s.amax())
        if torch.isnan(low) and torch.isnan(high):
            continue  # not a scaled weight
        if not torch.equal(low, high):  # two tensors of different scales (or one unscaled) joined into one
            raise Fp8LayoutError(f"component {name}: converting {key} joins float8 weights of different scales")
        converted_scales[key] = low.clone()
    return converted, converted_scales


def apply_scaled_float8_(name: str, module: torch.nn.Module, key: str, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Make a Linear holding a float8 weight compute with it upcast and scaled in `dtype` (the scale becomes its
    buffer ``weight_scale``, float32, streamed with the block)."""
    if not isinstance(module, torch.nn.Linear):
        raise Fp8LayoutError(f"component {name}: float8 weight {key} belongs to a {type(module).__name__}; only Linear weights are read scaled")
    module.register_buffer("weight_scale", scale)
    # the name diffusers gives its layerwise-casting hook: diffusers reads the model's dtype from it, and layerstream
    # composes with it (casting allocates fresh tensors, so a streamed block's slot is only read)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(ScaledFloat8Upcast(dtype), "layerwise_casting")


class ScaledFloat8Upcast(ModelHook):
    """A diffusers model hook: the Linear's forward with its float8 weight upcast and scaled in `compute_dtype`."""

    def __init__(self, compute_dtype: torch.dtype):
        super().__init__()
        self.compute_dtype = compute_dtype

    def new_forward(self, module: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
        weight = module.weight.to(self.compute_dtype) * module.weight_scale.to(self.compute_dtype)
        return F.linear(input, weight, module.bias)
