"""`GenerationSize`: the one size type of a generation (height, width, frames, and where a caller needs them the
steps and the batch), with where each figure came from; `SizeCaps`: the bounds a caller will stay within, which
are not a size (`models.generation_size` sizes a model's generation by either)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, kw_only=True)
class GenerationSize:
    height: int | None = None
    """None: the pipeline picks (the model names no default, e.g. it sizes from an input image)."""
    width: int | None = None
    num_frames: int | None = None
    """Video: the frames; None (or 1) for an image."""
    num_inference_steps: int | None = None
    batch: int = 1
    """Outputs made (and decoded) by one call."""
    tokens: int | None = None
    """Latent tokens a DiT block sees, where the pipeline's geometry cannot count them (a pipeline that is not
    diffusers'); None: counted from the size."""
    source: str = "given"
    """Where the size came from ('the model's defaults', 'the server's largest request ...', how an input image
    led to it)."""
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Where each figure came from, by field ("height": "--height", "num_inference_steps": "the model's rules")."""

    def as_size(self) -> dict[str, int | None]:
        return {"height": self.height, "width": self.width, "num_frames": self.num_frames}

    def to_dict(self) -> dict[str, Any]:
        """Each figure with where it came from (`layerstream plan --json`'s ``generation``)."""
        figures = {**self.as_size(), "num_inference_steps": self.num_inference_steps, "tokens": self.tokens}
        return {
            name: {"value": value, "from": self.sources.get(name, self.source)}
            for name, value in figures.items() if value is not None
        }  # fmt: skip

    def describe(self) -> str:
        frames = f" x {self.num_frames} frames" if (self.num_frames or 1) > 1 else ""
        tokens = f", {self.tokens} tokens" if self.tokens is not None else ""
        return f"{self.height}x{self.width}{frames}{tokens} ({self.source})"


@dataclass(frozen=True, kw_only=True)
class SizeCaps:
    """The largest a caller will ask a loaded model for (None: no cap), as a server knows it before the model is
    loaded: bounds on sizes, not a size."""

    max_side_pixels: int | None = None
    max_frames: int | None = None
    max_work: int | None = None
    """Largest width x height x frames (x steps x n, each at least 1) of one request."""
    source: str
