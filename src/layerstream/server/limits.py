"""What the served model accepts, read once at startup, and the checks a request must pass before it queues.

The schema (`layerstream.server.schemas`) checks types and fixed ranges; this module checks what depends
on the model: the output kind, the size multiple (the VAE's spatial compression times the transformer's
patch size), the largest grid the transformer can position (Wan's rotary tables), the frame rule of video
VAEs (``num_frames - 1`` a multiple of the temporal compression; Wan: ``num_frames % 4 == 1``) and the
server's own caps, the work cap among them, and the keys of ``extra_params``. Each is decided by the model's
rules (`ModelRules`: its defaults, `check_geometry`, `image_problem`, `extra_params_problems`) or the request's
table (`request.checked_extra_params`), which this module only words for HTTP. Failing here is a 400 before any work
is queued, so a request never waits in line only to be refused, and never reaches the pipeline with a shape it
would crash on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from layerstream.models.geometry import pipeline_max_latent_positions
from layerstream.models.generation_size import GenerationSize
from layerstream.models.input_image import InputImageError, size_from_image
from layerstream.models.model_rules import ModelRules
from layerstream.models.work import WorkPrice, price_request
from layerstream.request import GenerationError, GenerationRequest, checked_extra_params
from layerstream.server.errors import ApiError, invalid_fields
from layerstream.server.schemas import MAX_SEED, ErrorDetail, GenerationBody, VideoGenerationRequest
from layerstream.server.settings import ACCELERATOR_STEPS, CPU_MAX_WORK, ServeSettings

@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """The served model's rules and defaults (`ModelRules`, as `Omni` and the command line read them) and the
    server's caps, already lowered to what the model can position."""

    rules: ModelRules
    max_frames: int
    """The smaller of --max-frames and what the transformer can position."""
    max_side_pixels: int
    """The smaller of --max-size and what the transformer can position."""
    max_latent_positions: int | None
    """Latent tokens per axis the transformer can position, when that is what bounds the two caps above."""
    max_work: int
    """--max-work: the largest price of one request (`models.work.price_request`)."""
    served_names: tuple[str, ...] = ()
    """--served-model-name: what a request's ``model`` may be; the first is the name answers give (`model`).
    Empty: the rules' model name alone."""

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
        rules=rules,
        served_names=settings.served_model_names or (default_served_name(omni.source),),
        max_frames=max_frames,
        max_side_pixels=max_side,
        max_latent_positions=pipeline_max_latent_positions(omni.pipeline) if bound_by_model else None,
        max_work=settings.max_work if settings.max_work is not None else default_max_work(rules, max_side, max_frames, omni.device),
    )


def default_served_name(source: Any) -> str:
    """The name a model is served under by default: as it was given (a Hub id, a tiny model), a folder by its
    own name (its path is no client's business)."""
    return Path(source.model).name if source.origin == "folder" else source.model


def default_max_work(rules: Any, max_side: int, max_frames: int, device: Any) -> int:
    """The work cap a server has unless --max-work sets one: on a CPU device the small `CPU_MAX_WORK` (minutes
    of a 2-core CPU); on an accelerator the largest request its size and frame caps allow at `ACCELERATOR_STEPS`
    steps (or the model's own default, if more), so that the model's own default generation, and every size its
    rules allow, is taken."""
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
    """The width, height, frames and steps `request` runs with: its own, else the size its input image leads
    to (`conditioned`), else the model's defaults."""
    size = request.width_height() or ((conditioned.width, conditioned.height) if conditioned is not None else (None, None))
    is_video = isinstance(request, VideoGenerationRequest)
    return limits.rules.filled(
        width=size[0], height=size[1], num_frames=request.num_frames if is_video else None,
        num_inference_steps=request.num_inference_steps,
    )  # fmt: skip


def image_size_for(
    request: GenerationBody, limits: ModelLimits, image_size: tuple[int, int], field: str = "image"
) -> GenerationSize:
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
    problem = limits.rules.image_problem(has_image=has_image)
    if problem == "takes_none":
        raise ApiError(
            400, f"{limits.model} takes no input image; drop {field}, or use {endpoint} without it",
            code="invalid_for_model", param=field,
        )  # fmt: skip
    if problem == "required":
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
    """Raise a 400 `ApiError` naming every field the served model cannot take (`conditioned`: the size the
    request's input image leads to); first a 400 naming each optional field the pipeline cannot take
    (``boundary_ratio`` on Flux), which is never dropped silently (400, as every check against the model: the
    document is one for every model)."""
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
    problems += _extra_params_problems(request, limits, conditioned)
    shape_problems = _size_problems(request, limits)
    if isinstance(request, VideoGenerationRequest):
        shape_problems += _frame_problems(request, limits)
    # the work of a shape the model cannot run means nothing: say what is wrong with the shape first
    problems += shape_problems or _work_problems(request, limits, conditioned)
    if problems:
        raise invalid_fields(400, problems, code="invalid_for_model")


def _extra_params_problems(
    request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None
) -> list[ErrorDetail]:
    """The keys of ``extra_params`` the model cannot take as given (a 400 naming ``extra_params.<key>``); a key
    the request itself refuses (one of its own fields) is answered at once."""
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
    if step > 1:
        examples = f"1, {1 + step}, {1 + 2 * step}, ..."
        allowed = f"an integer from 1 to {largest} with num_frames - 1 a multiple of {step} ({examples})"
    else:
        allowed = f"an integer from 1 to {largest}"
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


def _work_problems(
    request: GenerationBody, limits: ModelLimits, conditioned: GenerationSize | None
) -> list[ErrorDetail]:
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
