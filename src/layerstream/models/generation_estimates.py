"""What one generation holds: its size, the latent tokens a DiT block sees, and a block's activations (estimates
the planner and the host reserve share; pure, nothing runs)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Mapping
from typing import Any

from torch import nn

from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple

FALLBACK_SIZE = {"height": 1024, "width": 1024, "num_frames": 1}
"""Where a pipeline's `__call__` names no default (Flux leaves height and width None: 1024 is its own)."""


def generation_size(pipeline: Any, size: Mapping[str, int] | None = None) -> dict[str, int]:
    """`size` ({"height", "width", "num_frames"}) completed with the pipeline's own call defaults; an image
    pipeline (no `num_frames` in its call) makes one frame."""
    out = dict(size or {})
    defaults = inspect.signature(pipeline.__call__).parameters
    for key, fallback in FALLBACK_SIZE.items():
        default = defaults[key].default if key in defaults else None
        out.setdefault(key, default if isinstance(default, int) else fallback)
    if "num_frames" not in defaults:
        out["num_frames"] = 1
    return out


def latent_tokens(pipeline: Any, size: Mapping[str, int] | None = None) -> int:
    """Latent tokens a DiT block sees at `size` (default: the pipeline's own default height, width, frames)."""
    size = generation_size(pipeline, size)
    side = pipeline_size_multiple(pipeline)
    temporal = pipeline_frame_multiple(pipeline)
    frames = (size["num_frames"] - 1) // temporal + 1 if temporal else 1
    return max(size["height"] // side, 1) * max(size["width"] // side, 1) * frames


def block_activation_nbytes(block: nn.Module, tokens: int) -> int:
    """An estimate of the activations one forward of `block` holds at its peak over `tokens` tokens, in its
    dtype: the residual stream and its normed copy, beside either the attention's query, key, value and output
    (four of the hidden width: fused attention keeps no tokens x tokens matrix) or the widest layer's output and
    its activation. The hidden width is the input width most of the block's linear layers share."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0
    hidden = Counter(m.in_features for m in linears).most_common(1)[0][0]
    widest = max(m.out_features for m in linears)
    return tokens * max(6 * hidden, 2 * hidden + 2 * widest) * linears[0].weight.dtype.itemsize
