"""`GenerationSize`: the generation a loaded pipeline is planned for: the largest it will be asked for, which
estimates made when offload is enabled (the host reserve of `host_budget_gb: "auto"`) are sized to, and the
generation `layerstream plan` prices (its steps too).

Every figure a caller leaves out is the model's (`ModelRules`, the one reader of a model's defaults: an embedded
tiny model's small size, a real one's from its pipeline); where the caller knows the requests (`RequestSizes`:
the command line's size, the server's caps) it is the largest of them. It says where each figure came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS

if TYPE_CHECKING:
    from layerstream.models.model_rules import ModelRules


@dataclass(frozen=True, kw_only=True)
class GenerationSize:
    height: int
    width: int
    num_frames: int = 1
    source: str
    """Where the size came from ('the model's defaults', 'the server's largest request ...')."""
    tokens: int | None = None
    """Latent tokens a DiT block sees, where the pipeline's geometry cannot count them (a pipeline that is not
    diffusers'); None: counted from the size."""
    num_inference_steps: int | None = None
    """Denoising steps (`planned_generation` always says them; the host reserve does not need them)."""
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Where each figure came from, by field ("height": "--height", "num_inference_steps": "the model's rules")."""

    def as_size(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width, "num_frames": self.num_frames}

    def to_dict(self) -> dict[str, Any]:
        """Each figure with where it came from (`layerstream plan --json`'s ``generation``)."""
        figures = {**self.as_size(), "num_inference_steps": self.num_inference_steps}
        out: dict[str, Any] = {
            name: {"value": value, "from": self.sources.get(name, self.source)} for name, value in figures.items() if value is not None
        }
        if self.tokens is not None:
            out["tokens"] = {"value": self.tokens, "from": self.sources.get("tokens", self.source)}
        return out

    def describe(self) -> str:
        frames = f" x {self.num_frames} frames" if self.num_frames > 1 else ""
        tokens = f", {self.tokens} tokens" if self.tokens is not None else ""
        return f"{self.height}x{self.width}{frames}{tokens} ({self.source})"


@dataclass(frozen=True, kw_only=True)
class RequestSizes:
    """What a caller will ask a loaded model for: exact sizes (None: the model's default) or caps (None: no
    cap), as the command line and the server know them before the model is loaded."""

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    max_side_pixels: int | None = None
    max_frames: int | None = None
    max_work: int | None = None
    """Largest width x height x frames (x steps x n, each at least 1) of one request."""
    source: str = "the request's size"


MODEL_RULES = "the model's rules"
"""The source of a figure the caller left to the model."""


def generation_size_for(rules: ModelRules, requests: RequestSizes | None = None) -> GenerationSize:
    """The largest generation `rules`' model makes for `requests` (None: its defaults). Where the model names no
    default size (the pipeline picks, e.g. from an input image) and no cap bounds it: the largest square a
    request may ask for (`DEFAULT_MAX_SIDE_PIXELS`), which is said as its source."""
    if requests is None or not _has_caps(requests):
        requests = requests or RequestSizes()
        shape = rules.filled(height=requests.height, width=requests.width, num_frames=requests.num_frames)
        asked = requests.height or requests.width or requests.num_frames
        source = requests.source if asked else "the model's defaults"
        if shape.height is None or shape.width is None:
            largest = _largest_within_caps(rules, _NO_DEFAULT_SIZE)
            shape = rules.filled(height=shape.height or largest.height, width=shape.width or largest.width, num_frames=shape.num_frames)
            source = largest.source
        return GenerationSize(height=shape.height, width=shape.width, num_frames=shape.num_frames or 1, source=source)
    return _largest_within_caps(rules, requests)


_NO_DEFAULT_SIZE = RequestSizes(
    max_side_pixels=DEFAULT_MAX_SIDE_PIXELS,
    source=f"the largest request's side, {DEFAULT_MAX_SIDE_PIXELS} (the model names no default size)",
)


def planned_generation(
    rules: ModelRules,
    *,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    num_inference_steps: int | None = None,
    tokens: int | None = None,
    sources: Mapping[str, str] | None = None,
) -> GenerationSize:
    """The generation to plan for: the figures given (each from ``sources[name]``, default "given") and the
    model's rules for the rest, the steps included."""
    given = {"height": height, "width": width, "num_frames": num_frames, "num_inference_steps": num_inference_steps, "tokens": tokens}
    size = generation_size_for(rules, RequestSizes(height=height, width=width, num_frames=num_frames, source="the size planned"))
    # the model's rules, or the fallback where it names no size (`generation_size_for` says which)
    left = size.source if size.source == _NO_DEFAULT_SIZE.source else MODEL_RULES
    origin = {"height": left, "width": left, "num_inference_steps": MODEL_RULES}
    origin["num_frames"] = MODEL_RULES if rules.kind == "video" else "an image model makes one frame"
    origin.update({name: (sources or {}).get(name, "given") for name, value in given.items() if value is not None})
    return GenerationSize(
        height=size.height, width=size.width, num_frames=size.num_frames, tokens=tokens,
        num_inference_steps=rules.filled(num_inference_steps=num_inference_steps).num_inference_steps,
        source=size.source, sources=MappingProxyType(origin),
    )  # fmt: skip


def pipeline_generation(pipeline: Any, **given: int | None) -> GenerationSize:
    """`planned_generation` by the rules read from `pipeline` itself, named by its class: the figures `given`
    (`height`, `width`, `num_frames`, `num_inference_steps`, `tokens`) and the model's defaults for the rest. A
    caller that knows the model's name (an embedded tiny model's small defaults come with it) reads its rules with
    it instead (`Omni.rules`, `layerstream plan`)."""
    from layerstream.models.model_rules import read_model_rules

    return planned_generation(read_model_rules(pipeline, type(pipeline).__name__), **given)


def _has_caps(requests: RequestSizes) -> bool:
    return any(v is not None for v in (requests.max_side_pixels, requests.max_frames, requests.max_work))


def _largest_within_caps(rules: ModelRules, requests: RequestSizes) -> GenerationSize:
    """The largest square of whole size multiples and the most frames of the model's frame rule within the caps
    and the model's own reach; the work cap lowers the frames first, then the side."""
    geometry, multiple = rules.geometry, max(rules.size_multiple, 1)
    side = min(v for v in (requests.max_side_pixels, geometry.max_side_pixels) if v is not None) if (
        requests.max_side_pixels is not None or geometry.max_side_pixels is not None
    ) else max(rules.default_height or 0, rules.default_width or 0) or 1024
    frames = 1
    if rules.kind == "video":
        caps = [v for v in (requests.max_frames, geometry.max_frames) if v is not None]
        frames = min(caps) if caps else (rules.default_num_frames or 1)
    if requests.max_work is not None:
        frames = max(1, min(frames, requests.max_work // (side * side)))
        side = min(side, math.isqrt(requests.max_work // frames))
    step = rules.frame_multiple or 1
    frames = frames - (frames - 1) % step if rules.kind == "video" else 1
    side = max(multiple, side - side % multiple)
    return GenerationSize(height=side, width=side, num_frames=frames, source=requests.source)


def server_requests(settings: Any) -> RequestSizes:
    """The caps of a server's settings (`max_side_pixels`, `max_frames`, `max_work`) as `RequestSizes`."""
    return RequestSizes(
        max_side_pixels=settings.max_side_pixels, max_frames=settings.max_frames, max_work=settings.max_work,
        source=f"the server's largest request: side {settings.max_side_pixels}, {settings.max_frames} frames, work {settings.max_work}",
    )  # fmt: skip
