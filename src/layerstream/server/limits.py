"""What the served model accepts, read once at startup, and the checks a request must pass before it queues: what
depends on the model (its `ModelRules` decide; this module words their refusals as a 400) and the server's caps."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from layerstream.models.geometry import pipeline_max_latent_positions
from layerstream.models.input_image import InputImageError, size_from_image
from layerstream.models.model_rules import ModelRules
from layerstream.models.output_limits import MAX_SEED
from layerstream.models.size import GenerationSize
from layerstream.models.work import WorkPrice, price_request
from layerstream.request import GenerationError, GenerationRequest, checked_extra_params
from layerstream.server.errors import ApiError, invalid_fields
from layerstream.server.schemas import ErrorDetail, GenerationBody, VideoGenerationRequest
from layerstream.server.settings import ACCELERATOR_STEPS, CPU_MAX_WORK, ServeSettings


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """The served model's rules (`ModelRules`) and the server's caps, lowered to what the model can position."""

    rules: ModelRules
    max_frames: int  # the smaller of --max-frames and what the transformer can position
    max_side_pixels: int  # the smaller of --max-size and what the transformer can position
    max_latent_positions: int | None  # per axis, when that is what bounds the two caps above
    max_work: int  # --max-work: the largest price of one request (`models.work.price_request`)
    served_names: tuple[str, ...] = ()  # --served-model-name; empty: the rules' model name alone

    # the rules' figures, as the checks below read them
    model_names = property(lambda self: self.served_names or (self.rules.model,))
    model = property(lambda self: self.model_names[0])
    kind = property(lambda self: self.rules.kind)
    size_multiple = property(lambda self: self.rules.size_multiple)
    frame_multiple = property(lambda self: self.rules.frame_multiple)
    fps = property(lambda self: self.rules.fps)


def read_model_limits(omni: Any, settings: ServeSettings) -> ModelLimits:
    """The limits of `omni`'s model: its rules (`omni.rules`) and the server's caps lowered to its reach."""
    rules = omni.rules
    is_video = rules.kind == "video"
    model_side, model_frames = rules.geometry.max_side_pixels, rules.geometry.max_frames if is_video else None
    max_side = min(settings.max_side_pixels, model_side) if model_side else settings.max_side_pixels
    max_frames = min(settings.max_frames, model_frames) if model_frames else settings.max_frames
    bound_by_model = (model_side is not None and model_side < settings.max_side_pixels) or (
        model_frames is not None and model_frames < settings.max_frames
    )
    return ModelLimits(
        rules=rules, served_names=settings.served_model_names or (omni.source.shown_name,),
        max_frames=max_frames, max_side_pixels=max_side,
        max_latent_positions=pipeline_max_latent_positions(omni.pipeline) if bound_by_model else None,
        max_work=settings.max_work if settings.max_work is not None else default_max_work(rules, max_side, max_frames, omni.device),
    )  # fmt: skip


def default_max_work(rules: Any, max_side: int, max_frames: int, device: Any) -> int:
    """The work cap without --max-work: `CPU_MAX_WORK` on a CPU; on an accelerator the largest request the size
    and frame caps allow at `ACCELERATOR_STEPS` steps (or the model's default, if more)."""
    if torch.device(device).type == "cpu":
        return CPU_MAX_WORK
    steps = max(ACCELERATOR_STEPS, rules.default_num_inference_steps)
    largest = GenerationRequest(
        prompt="", height=max_side, width=max_side, num_frames=max_frames if rules.kind == "video" else None,
        num_inference_steps=steps,
    )  # fmt: skip
    return price_request(rules, largest, max_side_pixels=max_side).work


def request_shape(
    request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None = None
) -> GenerationSize:
    """The shape `request` runs with: its own, else its input image's (`conditioned`), else the model's defaults."""
    size = request.width_height() or ((conditioned.width, conditioned.height) if conditioned is not None else (None, None))
    is_video = isinstance(request, VideoGenerationRequest)
    return limits.rules.filled(
        width=size[0], height=size[1], num_frames=request.num_frames if is_video else None,
        num_inference_steps=request.num_inference_steps,
    )  # fmt: skip


def image_size_for(
    request: GenerationBody, limits: ModelLimits, image_size: tuple[int, int], field: str = "image"
) -> GenerationSize:
    """The output size an input image of `image_size` leads to; a 400 naming `field` if it is too small."""
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
    """A 400 naming `field` for an image the model does not take, or one it needs missing (`how` to send it)."""
    problem = limits.rules.image_problem(has_image=has_image)
    if problem == "takes_none":
        message = f"{limits.model} takes no input image; drop {field}, or use {endpoint} without it"
        raise ApiError(400, message, code="invalid_for_model", param=field)
    if problem == "required":
        if how is None:
            how = "POST /v1/images/edits with an image file part" if limits.kind == "image" else "image (base64)"
        message = f"{limits.model} generates from an input image: {field} is required; send it as {how}"
        raise ApiError(400, message, code="invalid_for_model", param=field)


def check_endpoint(limits: ModelLimits, endpoint_kind: str) -> None:
    """A 400 if `endpoint_kind` (``"image"``, ``"video"`` or ``"edit"``) is not for what the model makes."""
    if endpoint_kind == "edit":
        if limits.kind == "video":
            message = f"{limits.model} makes videos; send its input image as image on POST /v1/videos/generations"
            raise ApiError(400, message, code="wrong_endpoint_for_model")
        if limits.rules.image_problem(has_image=True) == "takes_none":
            message = f"{limits.model} takes no input image; use POST /v1/images/generations"
            raise ApiError(400, message, code="wrong_endpoint_for_model")
        return
    if endpoint_kind == limits.kind:
        return
    other = "/v1/videos/generations" if limits.kind == "video" else "/v1/images/generations"
    makes = "videos" if limits.kind == "video" else "images"
    asked = "videos" if endpoint_kind == "video" else "images"
    raise ApiError(400, f"{limits.model} makes {makes}, not {asked}; use POST {other}", code="wrong_endpoint_for_model")


def check_request(request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None = None) -> None:
    """A 400 naming every field the served model cannot take; first, alone, each optional field the pipeline
    has no use for (``boundary_ratio`` on Flux), never dropped silently."""
    rules = limits.rules
    refused = [name for name in rules.refused_fields(request.model_dump()) if name != "negative_prompt"]
    if refused:
        details = [ErrorDetail(param=name, message=f"not valid for {limits.model}: {rules.why_not(name)}", allowed="null") for name in refused]
        raise invalid_fields(400, details, code="invalid_for_model")
    problems: list[ErrorDetail] = []
    if request.model is not None and request.model not in limits.model_names:
        allowed = " or ".join(map(repr, limits.model_names)) + " (--served-model-name)"
        problems.append(ErrorDetail(param="model", message=f"{request.model!r} is not served here", allowed=allowed))
    if request.negative_prompt is not None and not limits.rules.supports_negative_prompt:
        message = f"{limits.model} takes no negative prompt"
        problems.append(ErrorDetail(param="negative_prompt", message=message, allowed="null"))
    if request.seed is not None and request.seed + request.n - 1 > MAX_SEED:
        message = f"{request.seed} is too large for n = {request.n} (output i uses seed + i)"
        problems.append(ErrorDetail(param="seed", message=message, allowed=f"at most {MAX_SEED - request.n + 1}"))
    problems += _extra_params_problems(request, limits, conditioned)
    shape_problems = _size_problems(request, limits)
    if isinstance(request, VideoGenerationRequest):
        shape_problems += _frame_problems(request, limits)
    # the work of a shape the model cannot run means nothing: say what is wrong with the shape first
    problems += shape_problems or _work_problems(request, limits, conditioned)
    if problems:
        raise invalid_fields(400, problems, code="invalid_for_model")


def _extra_params_problems(request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None) -> list:
    """The keys of ``extra_params`` the model cannot take; one the request's table refuses is a 400 at once."""
    if not request.extra_params:
        return []
    try:
        params = checked_extra_params(request.extra_params)
    except GenerationError as e:
        detail = ErrorDetail(param=e.field, message=f"{_json_text(e.value)} is not valid", allowed=e.allowed)
        raise invalid_fields(400, [detail], code="invalid_extra_params") from None
    steps = request_shape(request, limits, conditioned).num_inference_steps
    problems = limits.rules.extra_params_problems(params, num_inference_steps=steps)
    return [
        ErrorDetail(param=p.name, message=f"{_json_text(p.value)} is not valid for {limits.model}", allowed=p.allowed)
        for p in problems
    ]


def _json_text(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _size_problems(request: GenerationBody, limits: ModelLimits) -> list[ErrorDetail]:
    size = request.width_height()
    if size is None or not _violations(limits, width=size[0], height=size[1], num_frames=None):
        return []
    m, cap = limits.size_multiple, limits.max_side_pixels
    largest = cap - cap % m
    allowed = f"'WIDTHxHEIGHT' with each side a multiple of {m} from {m} to {largest} (e.g. '{4 * m}x{4 * m}')"
    if limits.max_latent_positions is not None:
        allowed += f"; {limits.model}'s transformer positions at most {limits.max_latent_positions} latent tokens per axis"
    return [ErrorDetail(param="size", message=f"{request.size!r} is not valid for {limits.model}", allowed=allowed)]


def _frame_problems(request: VideoGenerationRequest, limits: ModelLimits) -> list[ErrorDetail]:
    num_frames = limits.rules.filled(num_frames=request.num_frames).num_frames
    if num_frames is None or not _violations(limits, width=None, height=None, num_frames=num_frames):
        return []  # None: the pipeline's own default
    step = limits.frame_multiple or 1
    largest = limits.max_frames - (limits.max_frames - 1) % step
    allowed = f"an integer from 1 to {largest}"
    if step > 1:
        allowed += f" with num_frames - 1 a multiple of {step} (1, {1 + step}, {1 + 2 * step}, ...)"
    where = "" if request.num_frames is not None else " (the model's default)"
    return [ErrorDetail(param="num_frames", message=f"{num_frames}{where} is not valid for {limits.model}", allowed=allowed)]


def _violations(limits: ModelLimits, *, width: int | None, height: int | None, num_frames: int | None) -> list:
    """The model's own check (`ModelRules.check_geometry`) with the server's caps; the callers word it for HTTP."""
    return limits.rules.check_geometry(
        height=height, width=width, num_frames=num_frames, max_side_pixels=limits.max_side_pixels, max_frames=limits.max_frames
    )


def request_price(
    request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None = None
) -> WorkPrice:
    """The price of `request` as it will run (`request_shape`), by the one pricing function."""
    shape = request_shape(request, limits, conditioned)
    filled = replace(
        request.generation_request(seed=0), width=shape.width, height=shape.height, num_frames=shape.num_frames,
        num_inference_steps=shape.num_inference_steps,
    )  # fmt: skip
    return price_request(limits.rules, filled, max_side_pixels=limits.max_side_pixels)


def _work_problems(request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None) -> list:
    price = request_price(request, limits, conditioned)
    if price.work <= limits.max_work:
        return []
    message = f"{price.describe()} is more work than this server takes in one request"
    allowed = (
        "pixels x num_frames x num_inference_steps x passes (2 with classifier-free guidance) x n, plus the text "
        f"tokens, of at most {limits.max_work:,} (--max-work)"
    )
    return [ErrorDetail(param=_largest_factor(price, limits), message=message, allowed=allowed)]


def _largest_factor(price: WorkPrice, limits: ModelLimits) -> str:
    """The field that asks for the most beyond the model's defaults: the one to name, and to lower first."""
    side, default = limits.max_side_pixels, limits.rules.filled()
    ratios = {"n": float(price.n)} if price.n > 1 else {}  # n=1 cannot be lowered: never the one to name
    ratios["num_inference_steps"] = price.num_inference_steps / default.num_inference_steps
    ratios["num_frames"] = price.num_frames / (default.num_frames or 1)
    ratios["size"] = price.pixels / ((default.width or side) * (default.height or side))
    return max(ratios, key=lambda name: ratios[name])  # a tie names the first: the cheapest to lower
