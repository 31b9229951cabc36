"""Which tensors low-precision storage casts: exactly those diffusers' `enable_layerwise_casting` stores in low
precision, so that the output matches it on the resident model: every floating-point parameter and buffer of the
convolution, linear and embedding layers, except layers whose name (from the model's root) or an ancestor's matches
a skip pattern: diffusers' defaults (position and patch embeddings, norms, the outermost input and output
projections), what the model class declares (`_keep_in_fp32_modules`, `_skip_layerwise_casting_patterns`) and, with
PEFT installed, the adapter layers' names. A layer whose weight is float8 already (an fp8_scaled file's scaled Linear,
`models.fp8_scaled`) is stored as it is: its weight streams as the file's bytes and its per-tensor scale is never
rounded (a rounded scale would bias the whole layer's output)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from layerstream.runtime.packing.upcast import FLOAT8_DTYPES

CAST_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
    nn.Embedding,
)
"""Layers whose tensors are cast (subclasses included), as in diffusers' layerwise casting."""

DEFAULT_SKIP_PATTERNS: tuple[str, ...] = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
"""Regular expressions (searched in a module's dotted name) of layers that keep their dtype, for every model."""


def skip_patterns_for(model: nn.Module) -> tuple[str, ...]:
    """The default patterns plus the ones `model` declares, plus PEFT's adapter layer names."""
    patterns = list(DEFAULT_SKIP_PATTERNS)
    for attr in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        patterns += _as_patterns(getattr(model, attr, None))
    patterns += _peft_adapter_names()
    return tuple(dict.fromkeys(patterns))


def cast_module_ids(model: nn.Module, patterns: Iterable[str] | None = None) -> frozenset[int]:
    """Ids of the modules of `model` whose floating-point tensors are cast (a cast layer and everything under it). A
    module is skipped, with everything under it, when a pattern matches its dotted name from `model`; the walk stops at
    the first cast layer on each path."""
    patterns = tuple(skip_patterns_for(model) if patterns is None else patterns)
    compiled = [re.compile(p) for p in patterns]
    out: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if any(p.search(name) for p in compiled):
            continue
        if isinstance(module, CAST_LAYER_TYPES):
            if getattr(module, "weight", None) is not None and module.weight.dtype in FLOAT8_DTYPES:
                continue  # scaled float8: kept as it is
            out.update(id(m) for m in module.modules())
            continue
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return frozenset(out)


def _as_patterns(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _peft_adapter_names() -> list[str]:
    try:  # optional: without PEFT there are no adapter layers to skip
        from peft.tuners.loha.layer import LoHaLayer
        from peft.tuners.lokr.layer import LoKrLayer
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        return []
    return [name for layer in (LoHaLayer, LoKrLayer, LoraLayer) for name in layer.adapter_layer_names]
