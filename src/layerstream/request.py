"""`GenerationRequest`, the arguments of one generation.

Every entry point builds one from the spellings of its field table (`models.request_fields`: flags, JSON keys,
`Omni` keywords), and everything after it (`Omni.run`, the server's queue, batches and waves, the rank messages)
reads that one object. It checks what needs no model (types, the table's bounds, prompt length, seeds, the keys of
``extra_params``) when built, raising `GenerationError` naming the field, the value seen and what is allowed; what
depends on the loaded pipeline (size multiples, frame rule, image input, the call's own keys) is its rules' to check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from layerstream.errors import LayerstreamError
from layerstream.json_object import MAX_JSON_DEPTH, JsonLimitError, JsonObject, check_json_depth, first_non_json
from layerstream.models.call_arguments import SET_BY_LAYERSTREAM
from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS, MAX_PROMPT_CHARS, MAX_SEED
from layerstream.models.request_fields import FIELD_BOUNDS, REQUEST_FIELDS


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


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation: ``n`` outputs of `prompt`, output ``i`` from seed ``seed + i``; each field as its table
    (`models.request_fields.REQUEST_FIELDS`) describes it (None: the model's default)."""

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
                if not bound.admits(value):  # a seed's bound depends on n: `_check_seed`
                    raise invalid_field(name, value, bound.allowed())
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
        message = f"{unknown[0]} is not a generation argument; expected one of {expected}"
        raise GenerationError(message, field=unknown[0])
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
