"""The bodies of ``POST /v1/videos`` and ``POST /v1/images/jobs``: OpenAI's fields and layerstream's own, as JSON
(strict, as every body) or as a multipart form (`FormReading`). A checked job body becomes the synchronous
endpoints' request, so a job is checked against the model exactly as a synchronous request is.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, field_validator

from layerstream.server.errors import ApiError
from layerstream.server.limits import ModelLimits
from layerstream.server.schemas import (
    ErrorDetail,
    FormReading,
    ImageGenerationRequest,
    RequestFields,
    VideoGenerationRequest,
    generation_fields,
)

SECONDS_PATTERN = r"^[0-9]{1,5}(\.[0-9]{1,6})?$"
SECONDS_SCHEMA = [
    {"type": "string", "pattern": r"^(?![0.]*$)[0-9]{1,5}(\.[0-9]{1,6})?$"},  # SECONDS_PATTERN, and not zero
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "null"},
]
"""What `seconds_value` takes, as the OpenAPI document states it."""


def _all_given(*names: str) -> dict[str, Any]:
    """The JSON schema of a body that gives every one of `names`, none of them null."""
    return {"required": list(names), "properties": {name: {"not": {"type": "null"}} for name in names}}


class _JobFields(RequestFields):
    """The fields both job bodies share: the synchronous bodies' generation fields, and previews."""

    preview: bool = Field(default=False, description="Send preview images on the job's event stream.")

    def _shared(self) -> dict[str, Any]:  # the fields the synchronous endpoints take too, as given
        return {name: getattr(self, name) for name in RequestFields.model_fields}


@generation_fields(
    "video",
    num_frames={"description": "Frames; give this or seconds, not both."},
    fps={"description": "Frame rate of the MP4 (and of seconds); default: the model's."},
)
class VideoJobRequest(_JobFields):
    """Body of ``POST /v1/videos`` (JSON); `input_reference` here is the image as base64 or a data URL."""

    image_field: ClassVar[str] = "input_reference"
    """The field of the input image, named by every error about the image."""
    # seconds or num_frames, not both (`generation_body` refuses both), as the document says
    model_config = ConfigDict(json_schema_extra={"not": _all_given("seconds", "num_frames")})

    seconds: str | int | float | None = Field(
        default=None,
        description="Duration; mapped to frames at the model's frame rate and frame rule.",
        json_schema_extra={"anyOf": SECONDS_SCHEMA},
    )
    width: int | None = Field(default=None, ge=1, le=999_999, description="Pixels, with height (vllm-omni's); or size.")
    height: int | None = Field(default=None, ge=1, le=999_999, description="Pixels, with width; or size.")
    input_reference: str | None = Field(default=None, min_length=1, description="Image-to-video: the input image.")

    @field_validator("seconds")
    @classmethod
    def _check_seconds(cls, seconds: str | int | float | None) -> str | int | float | None:
        if seconds is not None:
            seconds_value(seconds)  # a ValueError: a 422 naming seconds
        return seconds

    def generation_body(self, limits: ModelLimits) -> VideoGenerationRequest:
        """The synchronous endpoint's request for this job (seconds turned into frames at its frame rate: the
        body's fps, else the model's; width and height into size)."""
        fps = self.frame_rate(limits)
        num_frames = self.num_frames
        if self.seconds is not None:
            if num_frames is not None:
                message = f"seconds = {self.seconds!r} and num_frames = {num_frames} both given; give one of them"
                raise ApiError(422, message, code="invalid_request_body", param="seconds")
            num_frames = frames_for_seconds(seconds_value(self.seconds), fps, limits)
        return VideoGenerationRequest(**{**self._shared(), "size": self._size()}, num_frames=num_frames, fps=fps)

    def frame_rate(self, limits: ModelLimits) -> int:
        return self.fps if self.fps is not None else limits.fps

    def _size(self) -> str | None:
        """`size`, or vllm-omni's width and height (both, and agreeing with size where that is given too)."""
        if self.width is None and self.height is None:
            return self.size
        if self.width is None or self.height is None:
            missing, given = ("width", "height") if self.width is None else ("height", "width")
            # 400, as every check past the schema (which cannot say "both or neither" of two nullable fields)
            raise ApiError(400, f"{given} given without {missing}; give both, or size 'WIDTHxHEIGHT'", code="invalid_request", param=missing)
        size = f"{self.width}x{self.height}"
        if self.size is not None and self.size != size:
            message = f"size = {self.size!r} and width x height = {size!r} disagree; give one of them, or equal ones"
            raise ApiError(400, message, code="invalid_request", param="size")
        return size


class ImageJobRequest(_JobFields):
    """Body of ``POST /v1/images/jobs`` (JSON); `image` here is the input image as base64 or a data URL."""

    image_field: ClassVar[str] = "image"

    image: str | None = Field(default=None, min_length=1, description="Edit models: the input image.")

    def generation_body(self, limits: ModelLimits) -> ImageGenerationRequest:
        return ImageGenerationRequest(**self._shared())


class VideoJobForm(FormReading, VideoJobRequest):
    """``POST /v1/videos`` as a multipart form (OpenAI's client): `input_reference` comes as a file part."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class ImageJobForm(FormReading, ImageJobRequest):
    """``POST /v1/images/jobs`` as a multipart form: `image` comes as a file part."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


def seconds_value(seconds: str | int | float) -> float:
    """`seconds` as a number of seconds (OpenAI sends text such as "4"); a ValueError pydantic reports."""
    if isinstance(seconds, bool):
        raise ValueError("seconds must be a number or its text, not a boolean")
    if isinstance(seconds, str) and not re.fullmatch(SECONDS_PATTERN, seconds):
        raise ValueError(f"seconds = {seconds!r} is not a number of seconds such as '4' or '2.5'")
    value = float(seconds)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"seconds = {seconds!r} is not valid; expected a number of seconds > 0")
    return value


def frames_for_seconds(seconds: float, fps: int, limits: ModelLimits) -> int:
    """Frames for `seconds` at `fps`, on the model's frame rule (``num_frames - 1`` a multiple of its frame
    multiple: Wan 4 s at 16 fps is 65 frames); a 400 naming ``seconds`` if more than the server allows."""
    step = limits.frame_multiple or 1
    steps = seconds * fps / step  # inf for 1e308 seconds: more frames than any server makes
    frames = max(1, math.floor(steps) * step + (1 if step > 1 else 0)) if math.isfinite(steps) else math.inf
    if frames > limits.max_frames:
        most = (limits.max_frames - 1) / fps if step > 1 else limits.max_frames / fps
        detail = ErrorDetail(
            param="seconds",
            message=f"{seconds:g} s is {frames} frames at {fps} fps; {limits.model} on this server makes at most {limits.max_frames}",
            allowed=f"at most {most:g} seconds (--max-frames {limits.max_frames})",
        )
        raise ApiError(400, f"seconds: {detail.message}", code="invalid_for_model", param="seconds", details=[detail])
    return frames


def seconds_shown(body: VideoJobRequest, num_frames: int, fps: int) -> str:
    """OpenAI's `seconds` field of the job: as asked, or the frames' duration."""
    if body.seconds is not None:
        return str(body.seconds)
    return f"{num_frames / fps:g}"
