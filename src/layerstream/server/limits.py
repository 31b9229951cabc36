"""What the served model accepts, read once at startup, and the checks a request must pass before it queues.

The schema (`layerstream.server.schemas`) checks types and fixed ranges; this module checks what depends
on the model: the output kind, the size multiple (the VAE's spatial compression times the transformer's
patch size), the largest grid the transformer can position (Wan's rotary tables), the frame rule of video
VAEs (``num_frames - 1`` a multiple of the temporal compression; Wan: ``num_frames % 4 == 1``) and the
server's own caps, the work cap among them. Failing here is a 400 before any work is queued, so a request
never waits in line only to be refused, and never reaches the pipeline with a shape it would crash on.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

from layerstream.models.geometry import (
    pipeline_frame_multiple,
    pipeline_max_frames,
    pipeline_max_latent_positions,
    pipeline_max_side,
    pipeline_size_multiple,
)
from layerstream.models.input_image import (
    ConditionedSize,
    ImageInputKind,
    InputImageError,
    pipeline_image_input,
    size_from_image,
)
from layerstream.server.errors import ApiError, invalid_fields
from layerstream.server.schemas import MAX_SEED, ErrorDetail, GenerationBody, VideoGenerationRequest
from layerstream.server.settings import ServeSettings

# Omni.generate's own choice when neither the request nor the model names a step count
FALLBACK_NUM_INFERENCE_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """The served model's rules and defaults, and the server's caps (already lowered to the model's)."""

    model: str
    kind: Literal["image", "video"]
    size_multiple: int
    """Width and height must be multiples of this."""
    frame_multiple: int | None
    """Video: ``num_frames - 1`` must be a multiple of this (None: any count)."""
    default_width: int | None
    default_height: int | None
    default_num_frames: int | None
    default_num_inference_steps: int
    max_frames: int
    """The smaller of --max-frames and what the transformer can position."""
    max_side_pixels: int
    """The smaller of --max-size and what the transformer can position."""
    max_latent_positions: int | None
    """Latent tokens per axis the transformer can position, when that is what bounds the two caps above."""
    max_work: int
    """--max-work: width x height x frames x steps x n of one request."""
    supports_negative_prompt: bool
    image_input: ImageInputKind = "none"
    """Whether the model takes an input image (``"none"``, ``"optional"``, ``"required"``)."""


@dataclass(frozen=True)
class RequestShape:
    """What a request will really run, the model's defaults filled in."""

    width: int | None
    height: int | None
    num_frames: int | None
    num_inference_steps: int
    n: int

    def work(self, limits: ModelLimits) -> int:
        """width x height x frames x steps x n; a size the model picks itself counts as the largest allowed."""
        side = limits.max_side_pixels
        pixels = (self.width or side) * (self.height or side)
        return pixels * (self.num_frames or 1) * self.num_inference_steps * self.n


def read_model_limits(omni: Any, settings: ServeSettings) -> ModelLimits:
    """The limits of `omni`'s pipeline: the tiny model's spec, or what the pipeline itself declares."""
    from layerstream.models.loading import is_tiny_model_name

    pipeline = omni.pipeline
    call = inspect.signature(pipeline.__call__).parameters
    if is_tiny_model_name(omni.model):
        from layerstream.models.tiny import TINY_MODELS

        spec = TINY_MODELS[omni.model]
        size_multiple = spec.size_multiple
        defaults = dict(spec.default_kwargs)
    else:
        size_multiple = pipeline_size_multiple(pipeline)
        defaults = _call_defaults(pipeline, call)
    is_video = omni.kind == "video"
    model_side, model_frames = pipeline_max_side(pipeline), pipeline_max_frames(pipeline) if is_video else None
    max_side = min(settings.max_side_pixels, model_side) if model_side else settings.max_side_pixels
    max_frames = min(settings.max_frames, model_frames) if model_frames else settings.max_frames
    bound_by_model = (model_side is not None and model_side < settings.max_side_pixels) or (
        model_frames is not None and model_frames < settings.max_frames
    )
    return ModelLimits(
        model=omni.model,
        kind=omni.kind,
        size_multiple=size_multiple,
        frame_multiple=pipeline_frame_multiple(pipeline) if is_video else None,
        default_width=defaults.get("width"),
        default_height=defaults.get("height"),
        default_num_frames=defaults.get("num_frames") if is_video else None,
        default_num_inference_steps=defaults.get("num_inference_steps") or FALLBACK_NUM_INFERENCE_STEPS,
        max_frames=max_frames,
        max_side_pixels=max_side,
        max_latent_positions=pipeline_max_latent_positions(pipeline) if bound_by_model else None,
        max_work=settings.max_work,
        supports_negative_prompt="negative_prompt" in call,
        image_input=pipeline_image_input(pipeline),
    )


def request_shape(
    request: GenerationBody, limits: ModelLimits, conditioned: ConditionedSize | None = None
) -> RequestShape:
    """The width, height, frames and steps `request` runs with: its own, else the size its input image leads
    to (`conditioned`), else the model's defaults."""
    size = request.width_height()
    if size is not None:
        width, height = size
    elif conditioned is not None:
        width, height = conditioned.width, conditioned.height
    else:
        width, height = limits.default_width, limits.default_height
    is_video = isinstance(request, VideoGenerationRequest)
    num_frames = (request.num_frames or limits.default_num_frames) if is_video else None
    steps = request.num_inference_steps or limits.default_num_inference_steps
    return RequestShape(width, height, num_frames, steps, request.n)


def image_size_for(
    request: GenerationBody, limits: ModelLimits, image_size: tuple[int, int], field: str = "image"
) -> ConditionedSize:
    """The output size an input image of `image_size` leads to (the request's size, if it gives one); a 400
    naming `field` (the image's field) if the image is too small to leave a whole size multiple."""
    size = request.width_height()
    width, height = size if size is not None else (None, None)
    try:
        return size_from_image(
            image_size, size_multiple=limits.size_multiple, max_side=limits.max_side_pixels, width=width, height=height,
            name=field,
        )  # fmt: skip
    except InputImageError as e:
        raise ApiError(400, str(e), code="invalid_image", param=field) from None


def check_image_presence(
    limits: ModelLimits, *, has_image: bool, endpoint: str, field: str = "image", how: str | None = None
) -> None:
    """A 400 naming `field` if the request sends an image the model does not take, or lacks one it needs; `how`
    says how to send one (by default, as the synchronous endpoints take it)."""
    if has_image and limits.image_input == "none":
        raise ApiError(
            400, f"{limits.model} takes no input image; drop {field}, or use {endpoint} without it",
            code="invalid_for_model", param=field,
        )  # fmt: skip
    if not has_image and limits.image_input == "required":
        if how is None:
            how = "POST /v1/images/edits with an image file part" if limits.kind == "image" else "image (base64)"
        raise ApiError(
            400, f"{limits.model} generates from an input image: {field} is required; send it as {how}",
            code="invalid_for_model", param=field,
        )  # fmt: skip


def check_endpoint(limits: ModelLimits, endpoint_kind: str) -> None:
    """Raise a 400 `ApiError` naming what the model makes if the endpoint is for the other kind of output
    (``"image"``, ``"video"``, or ``"edit"``: images from an input image)."""
    if endpoint_kind == "edit":
        if limits.kind == "video":
            message = f"{limits.model} makes videos; send its input image as image on POST /v1/videos/generations"
            raise ApiError(400, message, code="wrong_endpoint_for_model")
        if limits.image_input == "none":
            message = f"{limits.model} takes no input image; use POST /v1/images/generations"
            raise ApiError(400, message, code="wrong_endpoint_for_model")
        return
    if endpoint_kind == limits.kind:
        return
    other = "/v1/videos/generations" if limits.kind == "video" else "/v1/images/generations"
    makes = "videos" if limits.kind == "video" else "images"
    asked = "videos" if endpoint_kind == "video" else "images"
    raise ApiError(400, f"{limits.model} makes {makes}, not {asked}; use POST {other}", code="wrong_endpoint_for_model")


def check_request(request: GenerationBody, limits: ModelLimits, conditioned: ConditionedSize | None = None) -> None:
    """Raise a 400 `ApiError` naming every field the served model cannot take (`conditioned`: the size the
    request's input image leads to)."""
    problems: list[ErrorDetail] = []
    if request.model is not None and request.model != limits.model:
        problems.append(
            ErrorDetail(param="model", message=f"{request.model!r} is not served here", allowed=repr(limits.model))
        )
    if request.negative_prompt is not None and not limits.supports_negative_prompt:
        problems.append(
            ErrorDetail(param="negative_prompt", message=f"{limits.model} takes no negative prompt", allowed="null")
        )
    if request.seed is not None and request.seed + request.n - 1 > MAX_SEED:
        problems.append(
            ErrorDetail(
                param="seed",
                message=f"{request.seed} is too large for n = {request.n} (output i uses seed + i)",
                allowed=f"at most {MAX_SEED - request.n + 1}",
            )
        )
    shape_problems = _size_problems(request, limits)
    if isinstance(request, VideoGenerationRequest):
        shape_problems += _frame_problems(request, limits)
    # the work of a shape the model cannot run means nothing: say what is wrong with the shape first
    problems += shape_problems or _work_problems(request, limits, conditioned)
    if problems:
        raise invalid_fields(400, problems, code="invalid_for_model")


def _size_problems(request: GenerationBody, limits: ModelLimits) -> list[ErrorDetail]:
    size = request.width_height()
    if size is None:
        return []
    m, cap = limits.size_multiple, limits.max_side_pixels
    largest = cap - cap % m
    allowed = f"'WIDTHxHEIGHT' with each side a multiple of {m} from {m} to {largest} (e.g. '{4 * m}x{4 * m}')"
    if limits.max_latent_positions is not None:
        allowed += f"; {limits.model}'s transformer positions at most {limits.max_latent_positions} latent tokens per axis"
    if any(side % m or side > largest for side in size):
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
    if num_frames > largest or (num_frames - 1) % step:
        where = "" if request.num_frames is not None else " (the model's default)"
        message = f"{num_frames}{where} is not valid for {limits.model}"
        return [ErrorDetail(param="num_frames", message=message, allowed=allowed)]
    return []


def _work_problems(
    request: GenerationBody, limits: ModelLimits, conditioned: ConditionedSize | None
) -> list[ErrorDetail]:
    shape = request_shape(request, limits, conditioned)
    work = shape.work(limits)
    if work <= limits.max_work:
        return []
    side = limits.max_side_pixels
    width, height = shape.width or side, shape.height or side
    factors = f"{width}x{height} pixels x {shape.num_frames or 1} frame(s) x {shape.num_inference_steps} step(s) x n={shape.n}"
    message = f"{factors} = {work:,} is more work than this server takes in one request"
    allowed = f"width x height x num_frames x num_inference_steps x n of at most {limits.max_work:,} (--max-work)"
    return [ErrorDetail(param=_largest_factor(shape, limits), message=message, allowed=allowed)]


def _largest_factor(shape: RequestShape, limits: ModelLimits) -> str:
    """The field that asks for the most beyond the model's defaults: the one to name, and to lower first."""
    side = limits.max_side_pixels
    default_pixels = (limits.default_width or side) * (limits.default_height or side)
    ratios = {"n": float(shape.n)} if shape.n > 1 else {}  # n=1 cannot be lowered: never the one to name
    ratios["num_inference_steps"] = shape.num_inference_steps / limits.default_num_inference_steps
    ratios["num_frames"] = (shape.num_frames or 1) / (limits.default_num_frames or 1)
    ratios["size"] = (shape.width or side) * (shape.height or side) / default_pixels
    return max(ratios, key=lambda name: ratios[name])  # a tie names the first: the cheapest to lower


def _call_defaults(pipeline: Any, call: Any) -> dict[str, int]:
    """The pipeline's own defaults for size, frames and steps, where its ``__call__`` says them.

    Pipelines that leave height and width None (Flux, Qwen-Image) compute them from ``default_sample_size``
    latent tokens times the VAE's compression.
    """
    defaults = {}
    for name in ("width", "height", "num_frames", "num_inference_steps"):
        value = call[name].default if name in call else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            defaults[name] = value
    sample, factor = getattr(pipeline, "default_sample_size", None), getattr(pipeline, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(factor, int):
        defaults.setdefault("width", sample * factor)
        defaults.setdefault("height", sample * factor)
    return defaults
