"""Request and response bodies of the HTTP API, OpenAI-style.

Requests are strict: a field of the wrong JSON type is an error, never coerced ("3" is not 3, 1.0 is not an int,
true is not a number), and an unknown field is an error rather than silently ignored (a typo such as
``"num_inference_step"`` is reported instead of quietly running the default). Each body's generation fields, with
their types, bounds and descriptions, are made from the request's field table (`generation_fields`, from
`models.request_fields`); `layerstream.server.limits` checks what depends on the served model. The JSON schema
of every model is frozen in ``tests/server/test_schema.py``: a change here is deliberate.
"""

from __future__ import annotations

import functools
import re
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from layerstream.json_object import JsonLimitError, read_json_text
from layerstream.models.output_limits import MAX_PROMPT_CHARS  # the command line's limits too
from layerstream.models.request_fields import REQUEST_FIELDS, BodyGroup, FieldBound, RequestField
from layerstream.request import GenerationRequest
from layerstream.server.image_outputs import MAX_KEPT_OUTPUT_BYTES, MAX_KEPT_OUTPUTS
from layerstream.wording import format_bytes

MAX_IMAGES_PER_REQUEST = 4
"""The server's cap on ``n`` (the library's is only ``n >= 1``): a serving policy, as ``--max-size`` is."""

SIZE_PATTERN = r"^[1-9][0-9]{0,5}x[1-9][0-9]{0,5}$"
AUTO_SIZE = "auto"
"""OpenAI's size meaning the model's default (with an input image: the image's size)."""
IMAGE_SIZE_PATTERN = r"^(auto|[1-9][0-9]{0,5}x[1-9][0-9]{0,5})$"
MAX_USER_CHARS = 256
_BODY_FIELDS = frozenset(name for name, field in REQUEST_FIELDS.items() if field.body is not None)
_CONSTANTS = {field.name: field.default for field in fields(GenerationRequest)}


def generation_fields(group: BodyGroup, **changes: dict[str, Any]):
    """A class decorator: the body with the table's fields of `group` added (`REQUEST_FIELDS`: type, bounds, default
    and description), each with its `changes` (a serving cap, a description of this body's own)."""

    def add_fields(body: type[BaseModel]) -> Any:
        taken = [name for name, field in REQUEST_FIELDS.items() if field.body == group]
        added = {name: _body_field(name, REQUEST_FIELDS[name], changes.get(name, {})) for name in taken}
        return create_model(body.__name__, __base__=body, __module__=body.__module__, __doc__=body.__doc__, **added)

    return add_fields


def _body_field(name: str, field: RequestField, changes: dict[str, Any]) -> tuple[Any, Any]:
    """(annotation, `Field`) of table field `name`: None when left out (the model's or the server's default),
    unless the request's own constant is the default; a required text is not empty."""
    bound = field.values if isinstance(field.values, FieldBound) else None
    kind = bound.kind if bound is not None else field.values
    kind = dict[str, Any] if kind is dict else kind
    spec: dict[str, Any] = {"description": field.description, **(bound.schema() if bound is not None else {})}
    if kind is str:
        spec.update(max_length=MAX_PROMPT_CHARS, **({"min_length": 1} if field.default == "required" else {}))
    if field.default == "constant":
        return kind, Field(default=_CONSTANTS[name], **{**spec, **changes})
    if field.default == "required":
        return kind, Field(**{**spec, **changes})
    return kind | None, Field(default=None, **{**spec, **changes})


@generation_fields("every")
class RequestFields(BaseModel):
    """The fields every body takes, the synchronous endpoints' and the jobs'."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    model: str | None = Field(default=None, description="If given, must name the served model.")
    size: str | None = Field(
        default=None,
        pattern=SIZE_PATTERN,
        description="'WIDTHxHEIGHT' in pixels, each a multiple of the model's size multiple; default: the model's.",
    )


@generation_fields("synchronous", n={"le": MAX_IMAGES_PER_REQUEST})
class GenerationBody(RequestFields):
    """The fields every synchronous generation endpoint takes; `ImageGenerationRequest` and
    `VideoGenerationRequest` add their own."""

    def width_height(self) -> tuple[int, int] | None:
        """``size`` as (width, height), or None for the model's default (no size, or ``"auto"``)."""
        if self.size is None or self.size == AUTO_SIZE:
            return None
        width, height = self.size.split("x")  # the shape was checked against SIZE_PATTERN
        return int(width), int(height)

    def generation_request(self, *, seed: int, image: Any = None) -> GenerationRequest:
        """The `GenerationRequest` this body asks for, the model's defaults left unfilled (None): `seed` is the
        first output's (the body's own, or one the server drew), `image` the input image (its `ImageFile`)."""
        width, height = self.width_height() or (None, None)
        given = {name: getattr(self, name) for name in type(self).model_fields if name in _BODY_FIELDS}
        return GenerationRequest(**{**given, "seed": seed}, image=image, height=height, width=width)


class ImageGenerationRequest(GenerationBody):
    """Body of ``POST /v1/images/generations``: the common fields plus OpenAI's image output fields."""

    size: str | None = Field(
        default=None,
        pattern=IMAGE_SIZE_PATTERN,
        description=(
            "'WIDTHxHEIGHT' in pixels, each a multiple of the model's size multiple, or 'auto'; default (and"
            " 'auto'): the model's."
        ),
    )
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json",
        description=(
            "'b64_json': the files inline, base64-encoded; 'url': a URL on this server for each file, kept in"
            f" memory for the newest {MAX_KEPT_OUTPUTS} outputs (at most {format_bytes(MAX_KEPT_OUTPUT_BYTES)}) until"
            " the server restarts."
        ),
    )
    output_format: Literal["png", "jpeg", "webp"] = Field(
        default="png", description="File format of each image: PNG (lossless), JPEG or WebP."
    )
    output_compression: int | None = Field(
        default=None,
        ge=0,
        le=100,
        description="JPEG and WebP: the encoder's quality, 0 to 100 (default 100, as OpenAI's); no effect on PNG (lossless).",
    )
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] | None = Field(
        default=None,
        description=(
            "OpenAI's quality tier: accepted and logged, with no effect (the output is set by"
            " num_inference_steps and size)."
        ),
    )
    user: str | None = Field(
        default=None,
        max_length=MAX_USER_CHARS,
        description="An id of the end user, as OpenAI takes it: accepted and logged, with no effect.",
    )


@generation_fields("video")
class VideoGenerationRequest(GenerationBody):
    """Body of ``POST /v1/videos/generations``: the common fields plus frames, frame rate and input image."""

    response_format: Literal["b64_json"] = Field(
        default="b64_json", description="Only 'b64_json': the MP4 files inline, base64-encoded."
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Image-to-video models: the input image (PNG, JPEG or WebP), base64-encoded, optionally as a data URL."
            " Without size the video takes the image's size, rounded down to the model's size multiple."
        ),
    )


class FormReading(BaseModel):
    """A body read from a multipart form, whose fields arrive as text: numbers are read from it ("2" is 2),
    ``extra_params`` is JSON text, and ``null`` (what OpenAPI tools send for null) or empty text (what httpx sends
    for None) where a field takes no empty text (`form_null_texts`) is absent. Listed first among a form's bases."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    @field_validator("extra_params", mode="before", check_fields=False)
    @classmethod
    def _extra_params_from_json_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return read_json_text(value)
        except JsonLimitError as e:  # a 400 naming the limit
            raise PydanticCustomError("extra_params_json", "extra_params is refused: {error}", {"error": str(e)}) from None
        except ValueError as e:  # not JSON: a 400, as vllm-omni answers (`errors.validation_error`)
            raise PydanticCustomError("extra_params_json", "extra_params is not valid JSON text ({error})", {"error": str(e)}) from None

    @model_validator(mode="before")
    @classmethod
    def _form_nulls_are_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        null_texts = form_null_texts(cls)
        return {
            name: None if isinstance(value, str) and value in null_texts.get(name, ()) else value
            for name, value in data.items()
        }


class ImageEditRequest(FormReading, ImageGenerationRequest):
    """The fields of ``POST /v1/images/edits`` besides its ``image`` file part (a multipart form, as OpenAI's, read
    as `FormReading` says). Unknown fields are still refused: an OpenAI field such as ``background`` (or ``mask``,
    text or file: the models served edit the whole image) is a 422 naming it, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    size: str | None = Field(
        default=None,
        pattern=IMAGE_SIZE_PATTERN,
        description=(
            "'WIDTHxHEIGHT' in pixels, or 'auto'; default (and 'auto'): the input image's size, rounded down to the"
            " model's size multiple."
        ),
    )


@functools.cache
def form_null_texts(model: type[BaseModel]) -> dict[str, frozenset[str]]:
    """For each nullable field of `model`, the form texts that mean null: ``"null"``, and ``""`` unless the
    field's schema lets a value be empty. Read from the JSON schema, so the rule is the served document's."""
    texts = {}
    for name, schema in model.model_json_schema()["properties"].items():
        options = schema.get("anyOf", [schema])
        values = [option for option in options if option.get("type") != "null"]
        if len(values) < len(options):
            texts[name] = frozenset({"null"} if any(map(_takes_empty_text, values)) else {"null", ""})
    return texts


def _takes_empty_text(schema: dict[str, Any]) -> bool:
    return (
        schema.get("type") == "string"
        and schema.get("minLength", 0) == 0
        and re.search(schema.get("pattern", ""), "") is not None
    )


# responses ---------------------------------------------------------------------------------------------------


class ImageData(BaseModel):
    b64_json: str | None = Field(
        default=None, description="The image file (in output_format), base64-encoded; null with response_format 'url'."
    )
    url: str | None = Field(default=None, description="response_format 'url': where to fetch the file; else null.")
    revised_prompt: None = Field(default=None, description="Always null: prompts are used as given.")


class VideoData(BaseModel):
    b64_json: str = Field(description="The MP4 file, base64-encoded.")
    mime_type: Literal["video/mp4"] = "video/mp4"


class GenerationUsage(BaseModel):
    """What the request cost, summed over its n outputs (``layerstream`` key of a response)."""

    model: str
    seeds: list[int]
    width: int
    height: int
    num_frames: int | None
    num_inference_steps: int
    queue_seconds: float = Field(description="Time spent waiting in the queue.")
    seconds: float = Field(description="Time spent generating (all outputs, excluding encoding).")
    seconds_per_step: float
    bytes_streamed: int = Field(description="Bytes copied to the device; in a batch, this request's share by outputs.")
    num_transfers: int = Field(description="Block copies issued; in a batch, the whole call's.")
    num_sync_loads: int
    stall_seconds: float
    device_bytes: int
    host_bytes: int
    peak_device_bytes: int | None
    size_note: str | None = Field(
        default=None, description="With an input image: how the output size was reached from the image's size."
    )
    batch_size: int = Field(
        default=1, description="Requests that shared the pipeline call (1: this request ran alone)."
    )
    vae_decode: str | None = Field(
        default=None,
        description="How the VAE decoded and why (vae_use_tiling): a tiled decode blends tile edges, so its "
        "output is not bit-identical to an untiled one.",
    )


class ImageGenerationResponse(BaseModel):
    created: int = Field(description="Unix time the response was made.")
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"] = Field(description="The format of every file in data.")
    size: str = Field(description="'WIDTHxHEIGHT' of the images, as generated.")
    layerstream: GenerationUsage


class VideoGenerationResponse(BaseModel):
    created: int
    data: list[VideoData]
    layerstream: GenerationUsage


class ErrorDetail(BaseModel):
    param: str | None = Field(description="The request field at fault (dotted path), or null.")
    message: str
    allowed: str | None = Field(default=None, description="What the field accepts, when that can be said.")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str
    details: list[ErrorDetail] = Field(default_factory=list)


class ErrorResponse(BaseModel):
    error: ErrorInfo


class RankHealth(BaseModel):
    rank: int
    host_bytes: int | None = Field(description="Host bytes of the rank's offload stores (None: nothing streamed).")


class ModelSourceInfo(BaseModel):
    model: str = Field(description="The model as the server was started with it (a folder: its name; the log has its path).")
    origin: Literal["tiny", "folder", "hub"]
    revision: str | None = Field(default=None, description="Hub ids: the revision asked for (main by default).")
    commit: str | None = Field(default=None, description="Hub ids: the commit the snapshot is of.")
    variant: str | None = Field(default=None, description="The weights variant loaded (fp16...), if one was asked for.")


class ModelCard(BaseModel):
    """OpenAI's model object: one name the served model answers to."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When the server started serving it (Unix seconds).")
    owned_by: str = "layerstream"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(description="The served model, under each name a request's model may give.")


class HealthResponse(BaseModel):
    status: Literal["ok", "draining", "rebuilding", "failed"] = Field(
        description="failed: a serving rank was lost; exiting. rebuilding: a failed wave's runtime is being rebuilt on every rank (requests wait)."
    )
    status_reason: str | None = Field(None, description="Why the status is not ok, where there is more to say (a rebuild).")
    model: str
    model_source: ModelSourceInfo = Field(description="Where the model's files came from.")
    kind: Literal["image", "video"]
    device: str
    dtype: str | None = Field(description="The dtype asked for with --dtype (None: each component as saved).")
    component_dtypes: dict[str, str] = Field(description="The dtype each model component computes in.")
    offload_config: dict[str, Any]
    queue_depth: int = Field(description="Requests waiting (not counting the one running).")
    max_queue: int
    running: bool = Field(description="Whether a generation is running now.")
    size_multiple: int
    frame_multiple: int | None = Field(description="Video: num_frames - 1 must be a multiple of this.")
    max_frames: int | None = Field(description="Video: most frames a request may ask for.")
    max_side_pixels: int = Field(description="Largest width or height a request may ask for.")
    max_work: int = Field(description="Largest price of a request: width x height x num_frames x num_inference_steps x passes x n, plus text tokens.")
    image_input: Literal["none", "optional", "required"] = Field(
        description="Whether the model takes an input image (POST /v1/images/edits, or image on /v1/videos/generations)."
    )
    max_image_bytes: int = Field(description="Largest input image file.")
    max_image_pixels: int = Field(description="Largest input image, width x height.")
    max_batch_size: int = Field(description="Most requests run as one pipeline call (1: no batching).")
    batch_wait_ms: float = Field(description="Longest a request waits for others to join its batch.")
    world_size: int = Field(description="Serving ranks (--nproc); rank 0 answers HTTP.")
    backend: str | None = Field(description="torch.distributed backend of the ranks (None: one process).")
    ranks: list[RankHealth] = Field(description="Each rank's host bytes, as of its last wave or check.")
    default_size: str | None = Field(description="'WIDTHxHEIGHT' a request without size makes (None: the pipeline's own).")
    default_num_frames: int | None = Field(description="Video: frames a request without num_frames or seconds makes.")
    default_steps: int = Field(description="Denoising steps a request without num_inference_steps runs.")
    fps: int | None = Field(description="Video: the model's frame rate, which seconds are mapped to frames at.")
    takes_image: bool = Field(description="Whether the model takes an input image (optional or required).")
    jobs_path: Literal["/v1/videos", "/v1/images/jobs"] | None = Field(
        description="Where the job API of this model is (None: not served)."
    )
    jobs_storage: str | None = Field(
        None, description="'ok', or why the data folder refused the job API's last write (full, read-only...)."
    )
    jobs_unreadable: int | None = Field(
        None, description="Rows of the job history that cannot be read (edited by hand, damaged): set aside, named in"
        " the log, left in the database as they are.",
    )
    jobs_bookkeeping: str | None = Field(
        None, description="'ok', or the last bookkeeping after a job's outcome (retention, metrics, events) that"
        " failed; the outcome stands.",
    )
