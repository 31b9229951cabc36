"""`GenerationSize`: the largest generation a loaded pipeline will be asked for, which estimates made when
offload is enabled (the host reserve of `host_budget_gb: "auto"`) are sized to.

Where no request is known it is the model's own default (`ModelRules`: an embedded tiny model's small size, a
real one's from its pipeline); where the caller knows the requests (`RequestSizes`: the command line's size, the
server's caps) it is the largest of them. It says where it came from, so the stats can say it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

    def as_size(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width, "num_frames": self.num_frames}

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


def generation_size_for(rules: ModelRules, requests: RequestSizes | None = None) -> GenerationSize | None:
    """The largest generation `rules`' model makes for `requests` (None: its defaults); None where the model
    names no default size and no cap bounds it (the pipeline then picks, e.g. from an input image)."""
    if requests is None or not _has_caps(requests):
        height = (requests.height if requests else None) or rules.default_height
        width = (requests.width if requests else None) or rules.default_width
        frames = ((requests.num_frames if requests else None) or rules.default_num_frames) if rules.kind == "video" else 1
        if height is None or width is None:
            return None
        source = requests.source if requests is not None and (requests.height or requests.width or requests.num_frames) else "the model's defaults"
        return GenerationSize(height=height, width=width, num_frames=frames or 1, source=source)
    return _largest_within_caps(rules, requests)


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
