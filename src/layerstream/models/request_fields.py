"""`REQUEST_FIELDS`: the one table of `request.GenerationRequest`'s fields, what each takes (`FieldBound`), where
its default comes from, which pipelines take it, and how each edge spells it. The request checks its bounds, the
HTTP bodies and the command line's flags are made from it, `Omni` takes its keywords and `ModelRules` its optional
fields; tests/test_request.py holds each edge to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from layerstream.models.output_limits import MAX_SEED


@dataclass(frozen=True)
class FieldBound:
    """The values a number takes (a request field, a flag): an int or a finite float within its bounds."""

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
            (isinstance(value, int) or math.isfinite(value))  # isfinite overflows on an int past a float's range
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

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
    """One field of `GenerationRequest`: what it takes, where its default comes from, which pipelines take it, and
    how each edge spells it: its name as the JSON key (and form field) of the bodies of `body`, `flag` on the
    command line, its name as an `Omni.generate` keyword where `omni`."""

    values: FieldBound | type
    """A number within its bounds, or a value of this type."""
    description: str
    """One line, as the HTTP schema (and the command line's help) shows it."""
    default: DefaultSource = "model"
    body: BodyGroup | None = "every"
    """None: no body takes it under its name (height and width are the text ``size``, each body names its image,
    --max-size is the server's)."""
    flag: str | None = None
    omni: bool = True
    only: Literal["call argument", "setting"] | None = None
    """Taken only by pipelines whose call has this argument, or that have this setting (a copy of the pipeline's
    or scheduler's config for the request's call); None: by every pipeline."""


_GUIDANCE = FieldBound(float, ge=0.0, le=MAX_GUIDANCE_SCALE)
_SIZE = "pixels, a multiple of the model's size multiple, at most max_side_pixels (--max-size); default: the model's"
REQUEST_FIELDS: Mapping[str, RequestField] = {
    "prompt": RequestField(str, "What to generate.", "required", flag="--prompt"),
    "negative_prompt": RequestField(
        str, "What to steer away from (classifier-free guidance).", flag="--negative-prompt", only="call argument"
    ),
    "image": RequestField(
        object, "The input image of image-to-video and image-editing models (a PIL image, a path or an array; a file"
        " on the command line); without a size the output takes its size, rounded down to the model's size multiple.",
        "none", body=None, flag="--image",
    ),
    "height": RequestField(FieldBound(int, ge=1), f"Height in {_SIZE}.", body=None, flag="--height"),
    "width": RequestField(FieldBound(int, ge=1), f"Width in {_SIZE}.", body=None, flag="--width"),
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
        _GUIDANCE, "Models with a true_cfg_scale argument (Flux, Qwen-Image): that argument; guidance_scale then goes"
        " to the model's own guidance_scale. Default: guidance_scale is the classifier-free scale.",
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
        FieldBound(int, ge=0, le=MAX_SEED), "Seed of the first output; default: random (reported).", "server",
        flag="--seed",
    ),
    "n": RequestField(
        FieldBound(int, ge=1), "Outputs to generate, with seeds seed, seed+1, ...", "constant", body="synchronous",
        omni=False,
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
"""Every field of `GenerationRequest`, in its order."""
FIELD_BOUNDS: Mapping[str, FieldBound] = {
    name: field.values for name, field in REQUEST_FIELDS.items() if isinstance(field.values, FieldBound)
}
OPTIONAL_FIELDS = tuple(name for name, field in REQUEST_FIELDS.items() if field.only)
CALL_ARGUMENT_FIELDS = tuple(name for name, field in REQUEST_FIELDS.items() if field.only == "call argument")
OMNI_KEYWORDS = frozenset(name for name, field in REQUEST_FIELDS.items() if field.omni)
