"""The host reserve of `host_budget_gb: "auto"`: what a generation allocates in host memory beside the host store,
estimated for its size (or `host_reserve_gb`, given): the decoded frames and their encoding, the text encoder's
outputs, and on a CPU device a DiT block's activations; never less than `FLOOR_NBYTES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torch import nn

from layerstream.models.generation_estimates import block_activation_nbytes, latent_tokens, text_output_nbytes
from layerstream.wording import GB, format_bytes

if TYPE_CHECKING:
    from layerstream.models.size import GenerationSize

FLOOR_NBYTES = round(0.15 * GB)  # Python objects, the tokenizer, the scheduler: an allowance, not measured
DECODED_BYTES_PER_VALUE = 13  # host bytes per pixel and channel at the decode's peak: three float32 copies, uint8
ENCODING_BYTES_PER_VALUE = 1  # host bytes per pixel and channel while the output file is encoded (a padded copy)


@dataclass(frozen=True)
class HostReserve:
    """The reserve (bytes) and how it was reached: the parts of the estimate, or the figure the config gave."""

    nbytes: int
    source: str  # 'host_reserve_gb' (given) or what the estimate was for ('estimated for 480x832 x 81 frames on cuda')
    parts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # empty where given
    size_source: str = ""  # the model's defaults, the largest request, the size planned

    @property
    def need_name(self) -> str:
        return "reserve (host_reserve_gb)" if self.source == "host_reserve_gb" else "reserve (estimated)"

    def describe(self) -> str:
        if not self.parts:
            return f"{format_bytes(self.nbytes)} ({self.source})"
        parts = " + ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items())
        floor = f", at least {format_bytes(FLOOR_NBYTES)}" if sum(self.parts.values()) < self.nbytes else ""
        size = f"; size: {self.size_source}" if self.size_source else ""
        return f"{format_bytes(self.nbytes)} ({self.source}: {parts}{floor}{size})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes, "source": self.source, "parts": dict(self.parts), "size_source": self.size_source,
            "reason": self.describe(),
        }  # fmt: skip


def estimate_host_reserve(
    pipeline: Any,
    *,
    device_is_host: bool,
    generation: GenerationSize,
    dit_blocks: tuple[nn.Module, ...] = (),
) -> HostReserve:
    """The reserve for one generation of `generation`'s size: pixels where the pipeline decodes them (it has a
    `vae`); `dit_blocks` (their first blocks) price the activations on a CPU device at its latent tokens."""
    size, tokens = generation.as_size(), generation.tokens
    parts: dict[str, int] = {}
    if getattr(pipeline, "vae", None) is not None:
        values = size["height"] * size["width"] * size["num_frames"] * 3
        parts["decoded frames"] = DECODED_BYTES_PER_VALUE * values
        parts["output encoding"] = ENCODING_BYTES_PER_VALUE * values
    text = text_output_nbytes(pipeline)
    if text:
        parts["text encoder outputs"] = text
    if device_is_host and dit_blocks:
        tokens = latent_tokens(pipeline, size) if tokens is None else tokens
        parts["activations (the device is the host)"] = max(block_activation_nbytes(b, tokens) for b in dit_blocks)
    frames = f" x {size['num_frames']} frames" if size["num_frames"] > 1 else ""
    at_tokens = f", {tokens} tokens" if tokens is not None and device_is_host and dit_blocks else ""
    source = f"estimated for {size['height']}x{size['width']}{frames}{at_tokens}"
    return HostReserve(max(sum(parts.values()), FLOOR_NBYTES), source, MappingProxyType(parts), generation.source)


def host_reserve_for(
    pipeline: Any, plan: Any, reserve_gb: float | None, *, device_is_host: bool, generation: GenerationSize,
) -> HostReserve:  # fmt: skip
    """`reserve_gb` where given, else the estimate for `plan`'s pipeline at `generation` (the largest it runs)."""
    from layerstream.plan.resolved import lookup

    if reserve_gb is not None:
        return HostReserve(round(reserve_gb * GB), "host_reserve_gb")
    firsts = [s.block_paths[0] for c in plan.components if c.category == "dit" for s in c.stacks if s.block_paths]
    blocks = tuple(lookup(pipeline, p) for p in firsts)
    return estimate_host_reserve(pipeline, device_is_host=device_is_host, generation=generation, dit_blocks=blocks)
