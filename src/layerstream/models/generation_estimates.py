"""What one generation holds: the latent tokens a DiT block sees at its size, and a block's activations (estimates
the planner and the host reserve share; pure, nothing runs). The size itself is the model's rules' business
(`models.generation_size`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from torch import nn

from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple

def latent_tokens(pipeline: Any, size: Mapping[str, int]) -> int:
    """Latent tokens a DiT block sees at `size` ({"height", "width", "num_frames"}: a `GenerationSize.as_size()`,
    the model's rules filling what a caller left out)."""
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
