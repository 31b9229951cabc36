"""The generation a loaded model is planned for: `generation_size_for` the largest it makes for a caller's
size or caps (the host reserve of `host_budget_gb: "auto"` is sized to it), `planned_generation` the one
`layerstream plan` prices. Figures a caller leaves out are the model's (`ModelRules`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS
from layerstream.models.size import GenerationSize, SizeCaps

if TYPE_CHECKING:
    from layerstream.models.model_rules import ModelRules


MODEL_RULES = "the model's rules"
"""The source of a figure the caller left to the model."""
_NO_DEFAULT_SIZE = SizeCaps(
    max_side_pixels=DEFAULT_MAX_SIDE_PIXELS,
    source=f"the largest request's side, {DEFAULT_MAX_SIDE_PIXELS} (the model names no default size)",
)


def generation_size_for(rules: ModelRules, requests: GenerationSize | SizeCaps | None = None) -> GenerationSize:
    """The largest generation `rules`' model makes for `requests` (None: its defaults). Where the model names no
    default size (the pipeline picks, e.g. from an input image) and no cap bounds it: the largest square a
    request may ask for (`DEFAULT_MAX_SIDE_PIXELS`), which is said as its source."""
    if isinstance(requests, SizeCaps):
        return _largest_within_caps(rules, requests)
    asked = requests or GenerationSize()
    shape = rules.filled(height=asked.height, width=asked.width, num_frames=asked.num_frames)
    source = asked.source if asked.height or asked.width or asked.num_frames else "the model's defaults"
    if shape.height is None or shape.width is None:
        largest = _largest_within_caps(rules, _NO_DEFAULT_SIZE)
        height, width = shape.height or largest.height, shape.width or largest.width
        shape = rules.filled(height=height, width=width, num_frames=shape.num_frames)
        source = largest.source
    return GenerationSize(height=shape.height, width=shape.width, num_frames=shape.num_frames or 1, source=source)


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
    asked = GenerationSize(height=height, width=width, num_frames=num_frames, source="the size planned")
    size = generation_size_for(rules, asked)
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
    """`planned_generation` by the rules read from `pipeline` itself, named by its class (an embedded tiny
    model's small defaults come with its name: `Omni.rules` and `layerstream plan` read its rules with it)."""
    from layerstream.models.model_rules import read_model_rules

    return planned_generation(read_model_rules(pipeline, type(pipeline).__name__), **given)


def _largest_within_caps(rules: ModelRules, caps: SizeCaps) -> GenerationSize:
    """The largest square of whole size multiples and the most frames of the model's frame rule within the caps
    and the model's own reach; the work cap lowers the frames first, then the side."""
    geometry, multiple = rules.geometry, max(rules.size_multiple, 1)
    sides = [v for v in (caps.max_side_pixels, geometry.max_side_pixels) if v is not None]
    side = min(sides) if sides else max(rules.default_height or 0, rules.default_width or 0) or 1024
    frames = 1
    if rules.kind == "video":
        frame_caps = [v for v in (caps.max_frames, geometry.max_frames) if v is not None]
        frames = min(frame_caps) if frame_caps else (rules.default_num_frames or 1)
    if caps.max_work is not None:
        frames = max(1, min(frames, caps.max_work // (side * side)))
        side = min(side, math.isqrt(caps.max_work // frames))
    step = rules.frame_multiple or 1
    frames = frames - (frames - 1) % step if rules.kind == "video" else 1
    side = max(multiple, side - side % multiple)
    return GenerationSize(height=side, width=side, num_frames=frames, source=caps.source)


def server_requests(settings: Any) -> SizeCaps:
    """The caps of a server's settings (`max_side_pixels`, `max_frames`, `max_work`)."""
    return SizeCaps(
        max_side_pixels=settings.max_side_pixels, max_frames=settings.max_frames, max_work=settings.max_work,
        source=f"the server's largest request: side {settings.max_side_pixels}, {settings.max_frames} frames, work {settings.max_work}",
    )  # fmt: skip
