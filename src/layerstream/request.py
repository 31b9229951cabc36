"""`GenerationRequest`, the arguments of one generation, and `REQUEST_FIELDS`, the one table of its fields.

Every entry point builds a request from the table's spellings (flags, JSON keys, `Omni` keywords), and everything
after it (`Omni.run`, the server's queue, batches and waves, the rank messages) reads that one object. It checks
what needs no model (types, the table's bounds, prompt length, seeds, ``extra_params``' keys) when built, raising
`GenerationError` naming the field, the value seen and what is allowed; what depends on the loaded pipeline (size
multiples, frame rule, image input, which ``extra_params`` keys its call takes) is the model's rules' to check.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from layerstream.errors import LayerstreamError
from layerstream.json_object import MAX_JSON_DEPTH, JsonLimitError, JsonObject, check_json_depth, first_non_json
from layerstream.models.call_arguments import SET_BY_LAYERSTREAM
from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS, MAX_PROMPT_CHARS, MAX_SEED


class GenerationError(LayerstreamError, ValueError):
    """Generation arguments the pipeline cannot take; raised for one field, it carries `field`, `value` and
    `allowed`, so an entry point can name the field its own way (a flag, an indexed argument of a batch)."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None, allowed: str | None = None):
        super().__init__(message)
        self.field = field
        self.value = value
        self.allowed = allowed


def invalid_field(field: str, value: Any, allowed: str, *, shown: str | None = None) -> GenerationError:
    """``"<field> = <value> is not valid; expected <allowed>"`` (`shown` replaces the value, e.g. for a long text)."""
    text = shown if shown is not None else repr(value)
    return GenerationError(f"{field} = {text} is not valid; expected {allowed}", field=field, value=value, allowed=allowed)


@dataclass(frozen=True)
class FieldBound:
    """The values a numeric field of `GenerationRequest` takes: an int or a finite float within its bounds."""

    kind: type[int] | type[float]
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    unit: str = ""
    """Words after "a number" in the phrase (" of seconds")."""

    def allowed(self) -> str:
        """What is allowed, as a phrase: ``"an integer from 1 to 1000"``, ``"a number from 0 to 100"``."""
        noun = "an integer" if self.kind is int else f"a{'' if self.le is not None else ' finite'} number{self.unit}"
        low = f">= {_shown(self.ge)}" if self.ge is not None else f"> {_shown(self.gt)}"
        if self.le is None:
            return f"{noun} {low}"
        if self.ge is not None:
            return f"{noun} from {_shown(self.ge)} to {_shown(self.le)}"
        return f"{noun} {low} and at most {_shown(self.le)}"

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int,) if self.kind is int else (int, float)):
            return False
        return (
            math.isfinite(value)
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def check(self, name: str, value: Any) -> None:
        if not self.admits(value):
            raise invalid_field(name, value, self.allowed())

    def schema(self) -> dict[str, Any]:
        """The bounds as pydantic's `Field` takes them (the HTTP bodies' schema)."""
        bounds = {name: getattr(self, name) for name in ("ge", "gt", "le") if getattr(self, name) is not None}
        return bounds if self.kind is int else {**bounds, "allow_inf_nan": False}


def _shown(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


MAX_INFERENCE_STEPS = 1000
MAX_GUIDANCE_SCALE = 100.0
"""Far above any model's useful guidance (Wan 5, Flux 3.5): a larger one is a typo."""
MAX_FPS = 120
MAX_TIMEOUT_SECONDS = 86_400.0
"""A day: the server answers within it or not at all."""

DefaultSource = Literal["required", "model", "constant", "server", "none"]
"""Where a value left out comes from: none may be left out; the model's rules (`ModelRules.filled`); the
request's own constant; the server (a seed drawn at random, its --max-size); nowhere (no image, no deadline)."""
BodyGroup = Literal["every", "synchronous", "video"]
"""Which HTTP bodies take a field under its name: every one, the synchronous endpoints', the video ones'."""


@dataclass(frozen=True)
class RequestField:
    """One field of `GenerationRequest`: what it takes, where its default comes from, and how each edge spells
    it (a form field is spelled as its JSON key; every `Omni` keyword as the field)."""

    values: FieldBound | type
    """A number within its bounds, or a value of this type."""
    description: str
    """One line, as the HTTP schema (and the command line's help) shows it."""
    default: DefaultSource = "model"
    body: BodyGroup | None = "every"
    """None: no body takes it under its name (a size is one text, each body names its image, --max-size is the
    server's)."""
    flag: str | None = None
    omni: bool = True
    only: Literal["call argument", "setting"] | None = None
    """Taken only by pipelines whose call has this argument, or that have this setting (a copy of the pipeline's
    or scheduler's config for the request's call); None: by every pipeline."""


_GUIDANCE = FieldBound(float, ge=0.0, le=MAX_GUIDANCE_SCALE)
_SIZE = "pixels, a multiple of the model's size multiple, at most max_side_pixels (--max-size)"
REQUEST_FIELDS: Mapping[str, RequestField] = {
    "prompt": RequestField(str, "What to generate.", "required", flag="--prompt"),
    "negative_prompt": RequestField(
        str, "What to steer away from (classifier-free guidance).", flag="--negative-prompt", only="call argument"
    ),
    "image": RequestField(
        object, "The input image of image-to-video and image-editing models (a PIL image, a path or an array; "
        "a file on the command line); without a size the output takes its size, rounded down to the model's size multiple.",
        "none", body=None, flag="--image",
    ),
    "height": RequestField(FieldBound(int, ge=1), f"Height in {_SIZE}; default: the model's.", body=None, flag="--height"),
    "width": RequestField(FieldBound(int, ge=1), f"Width in {_SIZE}; default: the model's.", body=None, flag="--width"),
    "num_frames": RequestField(
        FieldBound(int, ge=1), "Frames of each video; at most the server's --max-frames; default: the model's.",
        body="video", flag="--num-frames",
    ),
    "num_inference_steps": RequestField(
        FieldBound(int, ge=1, le=MAX_INFERENCE_STEPS), "Denoising steps; default: the model's.", flag="--steps"
    ),
    "guidance_scale": RequestField(
        _GUIDANCE, "Classifier-free guidance scale (1 or less turns guidance off); default: the model's.",
        flag="--guidance-scale",
    ),
    "guidance_scale_2": RequestField(
        _GUIDANCE, "Two-expert models (Wan 2.2 A14B): the low-noise expert's guidance scale; default: guidance_scale.",
        flag="--guidance-scale-2", only="call argument",
    ),
    "true_cfg_scale": RequestField(
        _GUIDANCE, "Models with a true_cfg_scale argument (Flux, Qwen-Image): that argument; guidance_scale then goes to"
        " the model's own guidance_scale. Default: guidance_scale is the classifier-free scale.",
        flag="--true-cfg-scale", only="call argument",
    ),
    "boundary_ratio": RequestField(
        FieldBound(float, ge=0.0, le=1.0),
        "Two-expert models: where the second expert takes over, a fraction of the timesteps; default: the model's.",
        flag="--boundary-ratio", only="setting",
    ),
    "flow_shift": RequestField(
        FieldBound(float, gt=0.0, le=100.0),
        "Models whose scheduler has a flow_shift (Wan): its value for this request; default: the model's.",
        flag="--flow-shift", only="setting",
    ),
    "seed": RequestField(
        FieldBound(int, ge=0, le=MAX_SEED), "Seed of the first output; default: random (reported).", "server", flag="--seed"
    ),
    "n": RequestField(
        FieldBound(int, ge=1), "Outputs to generate, with seeds seed, seed+1, ...", "constant", body="synchronous", omni=False
    ),
    "fps": RequestField(
        FieldBound(int, ge=1, le=MAX_FPS), "Frame rate of the encoded MP4; default: the model's (Wan 16, LTX 24).",
        body="video", flag="--fps",
    ),
    "max_side_pixels": RequestField(
        FieldBound(int, ge=1), "The largest --height or --width accepted, and the largest side of an output sized from"
        " its input image (the server's --max-size).", "server", body=None, flag="--max-size",
    ),
    "timeout": RequestField(
        FieldBound(float, gt=0.0, le=MAX_TIMEOUT_SECONDS, unit=" of seconds"),
        "Seconds from receipt to answer, queue and generation together; past it the request is answered 504"
        " and its generation stops at the next denoising step.", "none", body="synchronous", omni=False,
    ),
    "extra_params": RequestField(
        dict, "vllm-omni's extra call arguments, a JSON object (in a form, its JSON text): a key the model's call takes"
        " from JSON passes through, sample_solver ('unipc', 'euler', 'dpm++') picks the matching scheduler where"
        " the model has one; any other key, or a field of the request itself, is refused naming it.",
        "none", flag="--extra-params",
    ),
}  # fmt: skip
"""Every field of `GenerationRequest`, in its order; tests/test_request.py holds each edge to it."""
FIELD_BOUNDS: Mapping[str, FieldBound] = {n: f.values for n, f in REQUEST_FIELDS.items() if isinstance(f.values, FieldBound)}
OPTIONAL_FIELDS = tuple(name for name, field in REQUEST_FIELDS.items() if field.only)
CALL_ARGUMENT_FIELDS = tuple(name for name, field in REQUEST_FIELDS.items() if field.only == "call argument")
OMNI_KEYWORDS = frozenset(name for name, field in REQUEST_FIELDS.items() if field.omni)


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation: ``n`` outputs of `prompt`, output ``i`` from seed ``seed + i``; each field as
    `REQUEST_FIELDS` describes it (None: the model's default)."""

    prompt: str
    negative_prompt: str | None = None
    image: Any = None  # the server's requests carry their upload's bytes (`ImageFile`), decoded where they run
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    seed: int = 0
    n: int = 1
    fps: int | None = None
    max_side_pixels: int = DEFAULT_MAX_SIDE_PIXELS
    timeout: float | None = None  # enforced by the server (queue and generation), not by `Omni`
    extra_params: Mapping[str, Any] = JsonObject()
    """Held as a frozen `JsonObject` (given as a dict; None: none). A key is a call argument its pipeline family
    declares (`models.call_arguments`) or a vllm-omni key the model's rules map (``sample_solver``); never a
    field of this request (`EXTRA_PARAMS_REFUSED`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_params", checked_extra_params(self.extra_params))  # frozen: hashable
        _check_text("prompt", self.prompt, optional=False)
        _check_text("negative_prompt", self.negative_prompt, optional=True)
        for name, bound in FIELD_BOUNDS.items():
            value = getattr(self, name)
            if name != "seed" and (value is not None or name in ("n", "max_side_pixels")):  # None: the default
                bound.check(name, value)  # a seed's bound depends on n: `_check_seed`
        _check_seed(self.seed, self.n)

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.n))

    def outputs(self) -> tuple[GenerationRequest, ...]:
        """One request per output (``n = 1``, its own seed), for running them one after another."""
        return tuple(replace(self, seed=seed, n=1) for seed in self.seeds)

    def batch_shape(self) -> GenerationRequest:
        """This request without what may differ between the outputs of one pipeline call (prompt, seed, n, fps,
        timeout): requests with equal shapes (`extra_params` among them) can run as one batch."""
        return replace(self, prompt="", seed=0, n=1, fps=None, timeout=None)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, as it is (`extra_params` as a plain dict); `from_dict` builds it back."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"extra_params": self.extra_params.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationRequest:
        return request_from(data, REQUEST_FIELDS)


def request_from(given: Mapping[str, Any], allowed: Collection[str], **fixed: Any) -> GenerationRequest:
    """The request of `given` and `fixed`, each key of `given` one of `allowed` (another is refused, named): the
    keywords of `Omni.generate`, a request's dict."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        expected = ", ".join(sorted(allowed))
        raise GenerationError(f"{unknown[0]} is not a generation argument; expected one of {expected}", field=unknown[0])
    return GenerationRequest(**given, **fixed)


EXTRA_PARAMS_REFUSED: Mapping[str, str] = {
    **{name: f"the {name} field itself, not a key of extra_params" for name in REQUEST_FIELDS},
    **SET_BY_LAYERSTREAM,
}
"""Keys `extra_params` never takes, each with what to give instead: the request's own fields (one way to say
each thing, so a value cannot be given twice) and the call arguments layerstream sets (`SET_BY_LAYERSTREAM`)."""


def checked_extra_params(value: Any) -> JsonObject:
    """`value` (a mapping, or None for none) as a frozen JSON object, else a `GenerationError` naming
    ``extra_params`` or ``extra_params.<key>``."""
    if isinstance(value, JsonObject):
        return value
    if value is None:
        return JsonObject()
    if not isinstance(value, Mapping):
        raise invalid_field("extra_params", value, "a JSON object of call arguments (a dict), or None")
    try:
        check_json_depth(value, "extra_params")
    except JsonLimitError:  # no repr of the value: it is as deep as the recursion it would need
        allowed = f"at most {MAX_JSON_DEPTH} levels of nested arrays and objects"
        raise invalid_field("extra_params", value, allowed, shown=f"a value nested deeper than {MAX_JSON_DEPTH}") from None
    found = first_non_json(value, "extra_params")
    if found is not None:
        allowed = "a JSON value (null, a boolean, a finite number, a text, an array or an object with text keys)"
        raise invalid_field(found[0], found[1], allowed)
    for key, item in value.items():
        if key in EXTRA_PARAMS_REFUSED:
            raise invalid_field(f"extra_params.{key}", item, EXTRA_PARAMS_REFUSED[key])
    return JsonObject(value)


def _check_text(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise invalid_field(name, value, "a text" + (" or None" if optional else ""))
    if len(value) > MAX_PROMPT_CHARS:  # the length, not the text: it may be very long
        allowed = f"at most {MAX_PROMPT_CHARS:,} characters"
        raise invalid_field(name, value, allowed, shown=f"a text of {len(value):,} characters")


def _check_seed(seed: Any, n: int) -> None:
    most = MAX_SEED - n + 1  # output i uses seed + i
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= most:
        allowed = f"an integer from 0 to {most}" + (f" (output i of n = {n} uses seed + i)" if n > 1 else "")
        raise invalid_field("seed", seed, allowed)
