"""What one generation may ask for, shared by every entry point: the caps, checked before anything loads
(``--height 100000`` ran 76 s and took 15 GB of host memory before the model failed), and the loaded model's own
geometry. Checks return `LimitViolation`s, which each entry point words its own way (a flag, a JSON field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from layerstream.models.geometry import (
    pipeline_frame_multiple,
    pipeline_max_frames,
    pipeline_max_side,
    pipeline_size_multiple,
)

DEFAULT_MAX_SIDE_PIXELS = 2048
"""Largest height or width by default (the server's ``--max-size`` and the command line's)."""
DEFAULT_MAX_FRAMES = 129
"""Largest ``num_frames`` of a video by default (the server's ``--max-frames`` and the command line's)."""
MAX_SEED = 2**53 - 1
"""The largest a JSON client (a JavaScript number) holds exactly; all taken by ``manual_seed`` as they are."""
MAX_PROMPT_CHARS = 10_000
"""Longest prompt (and negative prompt), in characters, on the command line and the server alike."""
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest input image, in pixels (16.8 megapixels): checked from the file header, before decoding."""
DEFAULT_MAX_IMAGE_BYTES = 32 << 20


@dataclass(frozen=True)
class LimitViolation:
    """One argument a generation cannot take."""

    name: str
    """``"height"``, ``"width"`` or ``"num_frames"`` (or ``"extra_params.<key>"``: `ModelRules.extra_params_problems`)."""
    value: Any
    allowed: str
    """What would be accepted, as a phrase: ``"an integer from 1 to 2048"``."""


@dataclass(frozen=True, kw_only=True)
class OutputGeometry:
    """The sizes a loaded pipeline can make, read once from the pipeline."""

    size_multiple: int
    frame_multiple: int | None
    """Video: ``num_frames - 1`` must be a multiple of this (None: any count)."""
    max_side_pixels: int | None
    """The model's own largest height or width (None: only the caps limit it)."""
    max_frames: int | None
    """The model's own largest ``num_frames`` (None: only the caps limit it)."""


def read_output_geometry(pipeline: Any, kind: str) -> OutputGeometry:
    """The geometry of `pipeline`; `kind` is ``"image"`` or ``"video"`` (frame rules apply to video only)."""
    video = kind == "video"
    return OutputGeometry(
        size_multiple=pipeline_size_multiple(pipeline),
        frame_multiple=pipeline_frame_multiple(pipeline) if video else None,
        max_side_pixels=pipeline_max_side(pipeline),
        max_frames=pipeline_max_frames(pipeline) if video else None,
    )


def check_output_caps(
    *,
    height: int | None,
    width: int | None,
    num_frames: int | None,
    max_side_pixels: int = DEFAULT_MAX_SIDE_PIXELS,
    max_frames: int = DEFAULT_MAX_FRAMES,
) -> list[LimitViolation]:
    """Violations of the caps alone (no model needed); None means "the model's default", always within them."""
    problems = [
        LimitViolation(name, value, f"an integer from 1 to {max_side_pixels}")
        for name, value in (("height", height), ("width", width))
        if value is not None and not 1 <= value <= max_side_pixels
    ]
    if num_frames is not None and not 1 <= num_frames <= max_frames:
        problems.append(LimitViolation("num_frames", num_frames, f"an integer from 1 to {max_frames}"))
    return problems


def check_output_geometry(
    geometry: OutputGeometry, *, height: int | None, width: int | None, num_frames: int | None
) -> list[LimitViolation]:
    """Violations of what the model can make (run `check_output_caps` as well: this does not apply the caps)."""
    problems = []
    m, largest = geometry.size_multiple, geometry.max_side_pixels
    for name, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if value % m or (largest is not None and value > largest):
            reach = f" up to {largest - largest % m}" if largest is not None else ""
            problems.append(LimitViolation(name, value, f"a multiple of {m}{reach}"))
    if num_frames is not None:
        step = geometry.frame_multiple or 1
        most = geometry.max_frames
        if (num_frames - 1) % step or (most is not None and num_frames > most):
            rule = f"{step} * k + 1 (1, {1 + step}, {1 + 2 * step}, ...)" if step > 1 else "any count"
            reach = f" up to {most - (most - 1) % step}" if most is not None else ""
            problems.append(LimitViolation("num_frames", num_frames, f"{rule}{reach}"))
    return problems
