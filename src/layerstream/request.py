"""`GenerationRequest`: the arguments of one generation, validated once when built, then carried unchanged.

Every entry point builds one (the command line from its flags, the server from an HTTP body, `Omni.generate`
from its keywords) and everything after it (`Omni.run`, the server's queue, batcher and waves, the rank
messages) reads this one object. It checks what needs no model (types, ranges, prompt length, seeds) against
`FIELD_BOUNDS`, the one table of each numeric field's bounds, from which the command line's flags and the HTTP
bodies take theirs; what depends on the loaded pipeline (size multiples, frame rule, image input) is checked
by the model's rules (`ModelRules`). A bad value raises `GenerationError` naming the field, the value seen and
what is allowed. ``extra_params`` (vllm-omni's extra call arguments) is checked here for what needs no model
too: a JSON object, none of its keys a field of the request or an argument layerstream sets itself
(`EXTRA_PARAMS_REFUSED`); which keys the pipeline's call takes is the model's rules' to say.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from layerstream.errors import LayerstreamError
from layerstream.json_object import MAX_JSON_DEPTH, JsonLimitError, JsonObject, check_json_depth, first_non_json
from layerstream.models.call_arguments import SET_BY_LAYERSTREAM
from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS, MAX_PROMPT_CHARS, MAX_SEED


class GenerationError(LayerstreamError, ValueError):
    """Generation arguments the pipeline cannot take (names the argument, the value and what is allowed).

    Raised for one field, it also carries `field`, `value` and `allowed`, so an entry point can name the field
    its own way (a flag on the command line, an indexed argument of a batch)."""

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
        """Refuse `value` for field `name` unless it is within the bounds."""
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
_GUIDANCE = FieldBound(float, ge=0.0, le=MAX_GUIDANCE_SCALE)
FIELD_BOUNDS: dict[str, FieldBound] = {
    "height": FieldBound(int, ge=1), "width": FieldBound(int, ge=1), "num_frames": FieldBound(int, ge=1),
    "num_inference_steps": FieldBound(int, ge=1, le=MAX_INFERENCE_STEPS),
    "guidance_scale": _GUIDANCE, "guidance_scale_2": _GUIDANCE, "true_cfg_scale": _GUIDANCE,
    "boundary_ratio": FieldBound(float, ge=0.0, le=1.0),
    "flow_shift": FieldBound(float, gt=0.0, le=100.0),
    "seed": FieldBound(int, ge=0, le=MAX_SEED), "n": FieldBound(int, ge=1),
    "fps": FieldBound(int, ge=1, le=MAX_FPS),
    "max_side_pixels": FieldBound(int, ge=1),
    "timeout": FieldBound(float, gt=0.0, le=MAX_TIMEOUT_SECONDS, unit=" of seconds"),
}  # fmt: skip
"""Each numeric field's bounds, the one statement of them: `GenerationRequest` checks them, the command line's
flags parse with them (`cli.common.request_value`) and the HTTP bodies declare them (`server.schemas`);
`tests/test_request.py` holds every edge to them. A seed's upper bound also depends on ``n`` (`_check_seed`)."""


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation: ``n`` outputs of `prompt`, output ``i`` from seed ``seed + i``. None: the model's default."""

    prompt: str
    """What to generate; at most `MAX_PROMPT_CHARS` characters."""
    negative_prompt: str | None = None
    """What to steer away from (classifier-free guidance); None: the model's default."""
    image: Any = None
    """The input image of image-to-video and image-editing models (a PIL image, a path, an array, or an `ImageFile`:
    the server's requests carry their upload's bytes, decoded where they run)."""
    height: int | None = None
    """Pixels; with an input image and no size, the image's size is used (see `max_side_pixels`)."""
    width: int | None = None
    num_frames: int | None = None
    """Video models only."""
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    """The classifier-free guidance scale, from 0 to `MAX_GUIDANCE_SCALE` (where a pipeline takes classifier-free guidance
    through ``true_cfg_scale``, as Qwen-Image does, it goes there unless `true_cfg_scale` is given)."""
    guidance_scale_2: float | None = None
    """Two-expert pipelines (Wan 2.2 A14B): the low-noise expert's guidance scale; None: `guidance_scale`."""
    true_cfg_scale: float | None = None
    """Pipelines with a ``true_cfg_scale`` argument (Flux, Qwen-Image): that argument, as given; `guidance_scale`
    then goes to the pipeline's own ``guidance_scale`` (a distilled model's guidance input)."""
    boundary_ratio: float | None = None
    """Two-expert pipelines: where the second expert takes over, as a fraction of the training timesteps (the
    pipeline's config for this request only); 0 to 1."""
    flow_shift: float | None = None
    """Pipelines whose scheduler has a ``flow_shift`` (Wan's UniPC): its value for this request only; > 0."""
    seed: int = 0
    """The first output's seed, 0 to 2**53 - 1 (`MAX_SEED`: what a JSON client holds exactly)."""
    n: int = 1
    """Outputs to make, with seeds seed, seed + 1, ..."""
    fps: int | None = None
    """Frame rate of saved or encoded video; None: the model's (`ModelRules.fps`: Wan 16, LTX 24)."""
    max_side_pixels: int = DEFAULT_MAX_SIDE_PIXELS
    """Largest side of an output sized from its input image."""
    timeout: float | None = None
    """Seconds from receipt to answer, which the server enforces (queue and generation); `Omni` does not."""
    extra_params: Mapping[str, Any] = JsonObject()
    """Further arguments of the pipeline's call, vllm-omni's ``extra_params``: a JSON object (given as a dict,
    held as a frozen `JsonObject`; None: none). A key is a call argument its pipeline family declares
    (`models.call_arguments`), or a vllm-omni key the model's rules map (``sample_solver``); never a field of
    this request (`EXTRA_PARAMS_REFUSED`)."""

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
        """One seed per output."""
        return tuple(range(self.seed, self.seed + self.n))

    def outputs(self) -> tuple[GenerationRequest, ...]:
        """One request per output (``n = 1``, its own seed), for running them one after another."""
        return tuple(replace(self, seed=seed, n=1) for seed in self.seeds)

    def batch_shape(self) -> GenerationRequest:
        """This request without what may differ between the outputs of one pipeline call (prompt, seed, n, fps,
        timeout): requests with equal shapes (`extra_params` among them) can run as one batch."""
        return replace(self, prompt="", seed=0, n=1, fps=None, timeout=None)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, as it is (the image too; `extra_params` as a plain dict); `from_dict` builds the
        same request back."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"extra_params": self.extra_params.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationRequest:
        """The request `data` describes (as `to_dict` writes it), checked; an unknown key is refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise GenerationError(
                f"{unknown[0]} is not a generation argument; expected one of {', '.join(sorted(known))}", field=unknown[0]
            )
        return cls(**data)


EXTRA_PARAMS_REFUSED: Mapping[str, str] = {
    **{f.name: f"the {f.name} field itself, not a key of extra_params" for f in fields(GenerationRequest)},
    **SET_BY_LAYERSTREAM,
}
"""Keys `extra_params` never takes, each with what to give instead: the request's own fields (one way to say
each thing, so a value cannot be given twice) and the call arguments layerstream sets (`SET_BY_LAYERSTREAM`)."""


def checked_extra_params(value: Any) -> JsonObject:
    """`value` (a mapping, or None for none) as a frozen JSON object; a `GenerationError` naming
    ``extra_params`` or ``extra_params.<key>`` if it is not a JSON object or a key is refused."""
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
