"""What the served model accepts, read once at startup, and the checks a request must pass before it queues.

The schema (`layerstream.server.schemas`) checks types and fixed ranges; this module checks what depends
on the model: the output kind, the size multiple (the VAE's spatial compression times the transformer's
patch size), the frame rule of video VAEs (``num_frames - 1`` a multiple of the temporal compression;
Wan: ``num_frames % 4 == 1``) and the server's own caps. Failing here is a 400 before any work is queued,
so a request never waits in line only to be refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple
from layerstream.server.errors import ApiError, invalid_fields
from layerstream.server.schemas import ErrorDetail, ImageGenerationRequest, VideoGenerationRequest


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """The served model's rules and the server's caps."""

    model: str
    kind: str
    """``"image"`` or ``"video"``."""
    size_multiple: int
    """Width and height must be multiples of this."""
    frame_multiple: int | None
    """Video: ``num_frames - 1`` must be a multiple of this (None: any count)."""
    default_width: int | None
    default_height: int | None
    default_num_frames: int | None
    max_frames: int
    max_side_pixels: int
    supports_negative_prompt: bool


def read_model_limits(omni: Any, *, max_frames: int, max_side_pixels: int) -> ModelLimits:
    """The limits of `omni`'s pipeline: the tiny model's spec, or what the pipeline itself declares."""
    from layerstream.models.loading import is_tiny_model_name

    pipeline = omni.pipeline
    defaults: dict[str, Any] = {}
    if is_tiny_model_name(omni.model):
        from layerstream.models.tiny import TINY_MODELS

        spec = TINY_MODELS[omni.model]
        size_multiple = spec.size_multiple
        defaults = dict(spec.default_kwargs)
    else:
        size_multiple = pipeline_size_multiple(pipeline)
    frame_multiple = pipeline_frame_multiple(pipeline) if omni.kind == "video" else None
    call = inspect.signature(pipeline.__call__).parameters
    return ModelLimits(
        model=omni.model,
        kind=omni.kind,
        size_multiple=size_multiple,
        frame_multiple=frame_multiple,
        default_width=defaults.get("width"),
        default_height=defaults.get("height"),
        default_num_frames=defaults.get("num_frames") if omni.kind == "video" else None,
        max_frames=max_frames,
        max_side_pixels=max_side_pixels,
        supports_negative_prompt="negative_prompt" in call,
    )


def check_endpoint(limits: ModelLimits, endpoint_kind: str) -> None:
    """Raise a 400 `ApiError` naming what the model makes if the endpoint is for the other kind of output."""
    if endpoint_kind == limits.kind:
        return
    other = "/v1/videos/generations" if limits.kind == "video" else "/v1/images/generations"
    makes = "videos" if limits.kind == "video" else "images"
    asked = "videos" if endpoint_kind == "video" else "images"
    raise ApiError(400, f"{limits.model} makes {makes}, not {asked}; use POST {other}", code="wrong_endpoint_for_model")


def check_request(request: ImageGenerationRequest, limits: ModelLimits) -> None:
    """Raise a 400 `ApiError` naming every field the served model cannot take."""
    problems: list[ErrorDetail] = []
    if request.model is not None and request.model != limits.model:
        problems.append(
            ErrorDetail(param="model", message=f"{request.model!r} is not served here", allowed=repr(limits.model))
        )
    if request.negative_prompt is not None and not limits.supports_negative_prompt:
        problems.append(
            ErrorDetail(param="negative_prompt", message=f"{limits.model} takes no negative prompt", allowed="null")
        )
    problems += _size_problems(request, limits)
    if isinstance(request, VideoGenerationRequest):
        problems += _frame_problems(request, limits)
    if problems:
        raise invalid_fields(400, problems, code="invalid_for_model")


def _size_problems(request: ImageGenerationRequest, limits: ModelLimits) -> list[ErrorDetail]:
    size = request.width_height()
    if size is None:
        return []
    m, cap = limits.size_multiple, limits.max_side_pixels
    allowed = f"'WIDTHxHEIGHT' with each side a multiple of {m} from {m} to {cap - cap % m} (e.g. '{4 * m}x{4 * m}')"
    if any(side % m or side > cap for side in size):
        return [ErrorDetail(param="size", message=f"{request.size!r} is not valid for {limits.model}", allowed=allowed)]
    return []


def _frame_problems(request: VideoGenerationRequest, limits: ModelLimits) -> list[ErrorDetail]:
    num_frames = request.num_frames if request.num_frames is not None else limits.default_num_frames
    if num_frames is None:
        return []  # the pipeline's own default
    step = limits.frame_multiple or 1
    largest = limits.max_frames - (limits.max_frames - 1) % step
    if step > 1:
        examples = f"1, {1 + step}, {1 + 2 * step}, ..."
        allowed = f"an integer from 1 to {largest} with num_frames - 1 a multiple of {step} ({examples})"
    else:
        allowed = f"an integer from 1 to {largest}"
    if num_frames > limits.max_frames or (num_frames - 1) % step:
        where = "" if request.num_frames is not None else " (the model's default)"
        message = f"{num_frames}{where} is not valid for {limits.model}"
        return [ErrorDetail(param="num_frames", message=message, allowed=allowed)]
    return []
