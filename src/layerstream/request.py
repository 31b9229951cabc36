"""`GenerationRequest`: the arguments of one generation, validated once when built, then carried unchanged.

Every entry point builds one (the command line from its flags, the server from an HTTP body, `Omni.generate`
from its keywords) and everything after it (`Omni.run`, the server's queue, batcher and waves, the rank
messages) reads this one object. It checks what needs no model (types, ranges, prompt length, seeds); what
depends on the loaded pipeline (size multiples, frame rule, image input) is checked by `Omni` and the server's
limits. A bad value raises `GenerationError` naming the field, the value seen and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from layerstream.errors import LayerstreamError
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


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation: ``n`` outputs of `prompt`, output ``i`` from seed ``seed + i``. None: the model's default."""

    prompt: str
    """What to generate; at most `MAX_PROMPT_CHARS` characters."""
    negative_prompt: str | None = None
    """What to steer away from (classifier-free guidance); None: the model's default."""
    image: Any = None
    """The input image of image-to-video and image-editing models (a PIL image, a path or an array)."""
    height: int | None = None
    """Pixels; with an input image and no size, the image's size is used (see `max_side_pixels`)."""
    width: int | None = None
    num_frames: int | None = None
    """Video models only."""
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    """The classifier-free guidance scale, a finite number >= 0 (where a pipeline takes classifier-free guidance
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
    """The first output's seed, 0 to 2**64 - 1 (what ``torch.Generator.manual_seed`` takes as it is)."""
    n: int = 1
    """Outputs to make, with seeds seed, seed + 1, ..."""
    fps: int | None = None
    """Frame rate of saved or encoded video; None: the model's (`ModelRules.fps`: Wan 16, LTX 24)."""
    max_side_pixels: int = DEFAULT_MAX_SIDE_PIXELS
    """Largest side of an output sized from its input image."""
    timeout: float | None = None
    """Seconds from receipt to answer, which the server enforces (queue and generation); `Omni` does not."""

    def __post_init__(self) -> None:
        _check_text("prompt", self.prompt, optional=False)
        _check_text("negative_prompt", self.negative_prompt, optional=True)
        for name in ("height", "width", "num_frames", "num_inference_steps"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.fps is not None:
            _check_positive_int("fps", self.fps)
        for name in ("n", "max_side_pixels"):
            _check_positive_int(name, getattr(self, name))
        for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), "a finite number >= 0", lambda v: v >= 0)
        if self.boundary_ratio is not None:
            _check_number("boundary_ratio", self.boundary_ratio, "a number from 0 to 1", lambda v: 0 <= v <= 1)
        if self.flow_shift is not None:
            _check_number("flow_shift", self.flow_shift, "a finite number > 0", lambda v: v > 0)
        if self.timeout is not None:
            _check_number("timeout", self.timeout, "a finite number of seconds > 0", lambda v: v > 0)
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
        timeout): requests with equal shapes can run as one batch."""
        return replace(self, prompt="", seed=0, n=1, fps=None, timeout=None)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, as it is (the image too); `from_dict` builds the same request back."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

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


def _check_text(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise invalid_field(name, value, "a text" + (" or None" if optional else ""))
    if len(value) > MAX_PROMPT_CHARS:  # the length, not the text: it may be very long
        allowed = f"at most {MAX_PROMPT_CHARS:,} characters"
        raise invalid_field(name, value, allowed, shown=f"a text of {len(value):,} characters")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise invalid_field(name, value, "a positive integer")


def _check_number(name: str, value: Any, allowed: str, within) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not within(value):
        raise invalid_field(name, value, allowed)


def _check_seed(seed: Any, n: int) -> None:
    most = MAX_SEED - n + 1  # output i uses seed + i
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= most:
        allowed = f"an integer from 0 to {most}" + (f" (output i of n = {n} uses seed + i)" if n > 1 else "")
        raise invalid_field("seed", seed, allowed)
