"""`ModelRules`: what one loaded pipeline accepts and what it does when a request leaves a field out: its
geometry (`OutputGeometry`), image input, defaults (size, frames, steps and guidance from its ``__call__``; Flux
and Qwen-Image size from ``default_sample_size``; a tiny model's from its spec), frame rate (`FRAME_RATES`), the
optional fields it takes (a call argument, or a setting overridden for one call) and the ``extra_params`` its
family declares. Read once; `Omni`, the command line, the server and the planner ask it (`filled`,
`check_geometry`, `image_problem`) and only word its refusals, so the same request makes the same picture
everywhere."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from layerstream.models.call_arguments import CallArgument, declared_arguments
from layerstream.models.size import GenerationSize
from layerstream.models.input_image import ImageInputKind, pipeline_image_input
from layerstream.models.output_limits import (
    LimitViolation,
    OutputGeometry,
    check_output_caps,
    check_output_geometry,
    read_output_geometry,
)
from layerstream.models.request_fields import CALL_ARGUMENT_FIELDS, OPTIONAL_FIELDS
from layerstream.models.sample_solvers import SAMPLE_SOLVER, SOLVER_SCHEDULERS, solver_name, solvers_for

DEFAULT_FPS = 16
FRAME_RATES = {
    "WanPipeline": 16, "WanImageToVideoPipeline": 16, "WanVACEPipeline": 16,
    "LTXPipeline": 24, "LTXImageToVideoPipeline": 24, "LTXConditionPipeline": 24,
    "HunyuanVideoPipeline": 15, "HunyuanVideoImageToVideoPipeline": 15,
    "CogVideoXPipeline": 8, "CogVideoXImageToVideoPipeline": 8,
}  # fmt: skip
"""The frame rate each video pipeline's model was trained at (`DEFAULT_FPS` for others). By class: Wan 2.2's
5B TI2V model, trained at 24 fps, loads as `WanPipeline` too and is encoded at 16 unless a request says."""
FALLBACK_NUM_INFERENCE_STEPS = 50
"""Steps when neither the request nor the pipeline's ``__call__`` names a count (diffusers' usual default)."""


ImageProblem = Literal["takes_none", "required"]
"""What is wrong with a request's input image, or its absence: the model takes none, or needs one."""


@dataclass(frozen=True, kw_only=True)
class ModelRules:
    """One loaded pipeline's rules and defaults; see the module docstring for where each is read from."""

    model: str
    """The model as it was named (``"tiny-wan"``, a Hub id, a folder)."""
    pipeline_class: str
    kind: Literal["image", "video"]
    geometry: OutputGeometry
    image_input: ImageInputKind
    """Whether it takes an input image: ``"none"``, ``"optional"`` or ``"required"``."""
    default_width: int | None
    """Width of a request that gives none (None: the pipeline picks, e.g. from its input image)."""
    default_height: int | None
    default_num_frames: int | None
    """Video: frames of a request that gives none; None for images."""
    default_num_inference_steps: int
    default_guidance_scale: float | None
    """The classifier-free guidance scale of a request that gives none (where the pipeline takes CFG through
    ``true_cfg_scale``, that one's default); None: the pipeline names none."""
    default_negative_prompt: str | None = None
    """A tiny model's own recipe (Qwen-Image's blank negative); None for real models: the pipeline's."""
    fps: int
    """Video: the frame rate outputs are encoded at unless a request says (`FRAME_RATES`)."""
    takes: frozenset[str]
    """Of `OPTIONAL_FIELDS`, those this pipeline takes."""
    tiny: bool = False
    """An embedded tiny model: its defaults are passed to the pipeline, which has real-size ones of its own."""
    call_arguments: Mapping[str, CallArgument] = field(default_factory=lambda: MappingProxyType({}))
    """The ``__call__`` arguments an ``extra_params`` key passes through, as its family declares them."""
    sample_solvers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """vllm-omni's ``sample_solver`` values its scheduler has a counterpart for, each to the scheduler class it
    runs (`models.sample_solvers`); empty: none."""

    @property
    def size_multiple(self) -> int:
        return self.geometry.size_multiple

    @property
    def frame_multiple(self) -> int | None:
        return self.geometry.frame_multiple

    @property
    def supports_negative_prompt(self) -> bool:
        return "negative_prompt" in self.takes

    def filled(
        self, *, height: int | None = None, width: int | None = None, num_frames: int | None = None,
        num_inference_steps: int | None = None,
    ) -> GenerationSize:  # fmt: skip
        """The figures given, the model's defaults for those left out (None): the one place defaults are filled."""
        return GenerationSize(
            height=height if height is not None else self.default_height,
            width=width if width is not None else self.default_width,
            num_frames=num_frames if num_frames is not None or self.kind != "video" else self.default_num_frames,
            num_inference_steps=num_inference_steps or self.default_num_inference_steps,
        )

    def filled_for(self, request: Any) -> GenerationSize:
        """`filled` with a `GenerationRequest`'s own figures."""
        given = {k: getattr(request, k) for k in ("height", "width", "num_frames", "num_inference_steps")}
        return self.filled(**given)

    def check_geometry(
        self, *, height: int | None, width: int | None, num_frames: int | None,
        max_side_pixels: int | None = None, max_frames: int | None = None,
    ) -> list[LimitViolation]:  # fmt: skip
        """What the model cannot make of these sizes (multiples, reach, frame rule), and, where given, what lies
        past a caller's caps (`max_side_pixels`, `max_frames`: a server's); None fields are defaults."""
        problems = check_output_geometry(self.geometry, height=height, width=width, num_frames=num_frames)
        if max_side_pixels is not None or max_frames is not None:
            caps = check_output_caps(
                height=height, width=width, num_frames=num_frames,
                max_side_pixels=max_side_pixels or sys.maxsize, max_frames=max_frames or sys.maxsize,  # maxsize: no cap
            )  # fmt: skip
            problems += [cap for cap in caps if cap.name not in {p.name for p in problems}]
        return problems

    def image_problem(self, *, has_image: bool) -> ImageProblem | None:
        """Whether a request with (or without) an input image is refused, and why; each caller words it."""
        if has_image and self.image_input == "none":
            return "takes_none"
        if not has_image and self.image_input == "required":
            return "required"
        return None

    def refused_fields(self, given: dict[str, Any]) -> list[str]:
        """Of the optional fields `given` sets (not None), the ones this pipeline cannot take, in order."""
        return [name for name in OPTIONAL_FIELDS if given.get(name) is not None and name not in self.takes]

    def extra_params_problems(self, params: Mapping[str, Any], *, num_inference_steps: int) -> list[LimitViolation]:
        """Each key of `params` (a request's ``extra_params``, its keys already checked by the request) this
        pipeline cannot take as given, named ``extra_params.<key>`` with what it takes; `num_inference_steps`:
        the request's, which a step list must match. Each caller words them."""
        problems = []
        for key, value in params.items():
            if key in self.call_arguments:
                allowed = self.call_arguments[key].problem(value, num_inference_steps)
            elif key == SAMPLE_SOLVER:
                allowed = None if isinstance(value, str) and solver_name(value) in self.sample_solvers else self._solvers_taken()
            else:
                accepted = sorted({*self.call_arguments, *([SAMPLE_SOLVER] if self.sample_solvers else [])})
                allowed = f"one of the keys {self.pipeline_class} takes: {', '.join(accepted) or 'none'}"
            if allowed is not None:
                problems.append(LimitViolation(f"extra_params.{key}", value, allowed))
        return problems

    def _solvers_taken(self) -> str:
        if not self.sample_solvers:
            known = ", ".join(SOLVER_SCHEDULERS)
            return f"no sample_solver: {self.pipeline_class}'s scheduler has no counterpart of vllm-omni's ({known})"
        return f"one of {', '.join(map(repr, self.sample_solvers))} (any case)"

    def why_not(self, name: str) -> str:
        """Why this pipeline cannot take optional field `name`, as a phrase (for an error message)."""
        if name in ("boundary_ratio", "guidance_scale_2"):
            return f"{self.pipeline_class} has no second expert (a boundary_ratio in its config and a transformer_2)"
        if name == "flow_shift":
            return f"{self.pipeline_class}'s scheduler has no flow_shift setting"
        return f"{self.pipeline_class}'s __call__ takes no {name}"


def read_model_rules(pipeline: Any, model: str) -> ModelRules:
    """The rules of `pipeline`, loaded as `model`: an embedded tiny model's from its spec, a real one's from
    the pipeline itself."""
    from layerstream.models.geometry import pipeline_kind
    from layerstream.models.tiny import is_tiny_model_name

    kind = pipeline_kind(pipeline)
    call = inspect.signature(pipeline.__call__).parameters
    geometry = read_output_geometry(pipeline, kind)
    tiny = is_tiny_model_name(model)
    if tiny:
        from layerstream.models.tiny import TINY_MODELS

        defaults = dict(TINY_MODELS[model].default_kwargs)
        if "true_cfg_scale" in defaults:  # a request's guidance_scale is CFG: where it goes is the call's business
            defaults["guidance_scale"] = defaults.pop("true_cfg_scale")
    else:
        defaults = _call_defaults(pipeline, call)
    steps = defaults.get("num_inference_steps")
    guidance = defaults.get("guidance_scale")
    return ModelRules(
        model=model,
        pipeline_class=type(pipeline).__name__,
        kind=kind,
        geometry=geometry,
        image_input=pipeline_image_input(pipeline),
        default_width=defaults.get("width"),
        default_height=defaults.get("height"),
        default_num_frames=defaults.get("num_frames") if kind == "video" else None,
        default_num_inference_steps=steps if isinstance(steps, int) else FALLBACK_NUM_INFERENCE_STEPS,
        default_guidance_scale=float(guidance) if guidance is not None else None,
        default_negative_prompt=defaults.get("negative_prompt"),
        fps=FRAME_RATES.get(type(pipeline).__name__, DEFAULT_FPS),
        takes=_optional_fields_taken(pipeline, call),
        tiny=tiny,
        call_arguments=MappingProxyType(declared_arguments(pipeline)),
        sample_solvers=MappingProxyType(solvers_for(getattr(pipeline, "scheduler", None))),
    )


def _optional_fields_taken(pipeline: Any, call: Any) -> frozenset[str]:
    taken = {name for name in CALL_ARGUMENT_FIELDS if name in call}
    if two_experts(pipeline):
        taken.add("boundary_ratio")
    else:
        taken.discard("guidance_scale_2")  # Wan refuses it without a boundary (its check_inputs)
    scheduler_config = getattr(getattr(pipeline, "scheduler", None), "config", None)
    if scheduler_config is not None and "flow_shift" in scheduler_config:
        taken.add("flow_shift")
    return frozenset(taken)


def two_experts(pipeline: Any) -> bool:
    """Whether `pipeline` switches between two transformers at a boundary (Wan 2.2 A14B): its config names a
    boundary_ratio and it has a transformer_2."""
    config = getattr(pipeline, "config", None)
    return (
        config is not None
        and "boundary_ratio" in config
        and config["boundary_ratio"] is not None
        and getattr(pipeline, "transformer_2", None) is not None
    )


def _call_defaults(pipeline: Any, call: Any) -> dict[str, Any]:
    """The pipeline's own defaults for size, frames, steps and guidance, where its ``__call__`` says them.

    Pipelines that leave height and width None (Flux, Qwen-Image) compute them from ``default_sample_size``
    latent tokens times the VAE's compression. Guidance is ``true_cfg_scale``'s default where the pipeline
    takes classifier-free guidance there (its ``guidance_scale`` is then a distilled embedding's input)."""
    defaults: dict[str, Any] = {}
    for name in ("width", "height", "num_frames", "num_inference_steps"):
        value = call[name].default if name in call else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            defaults[name] = value
    for name in ("true_cfg_scale", "guidance_scale"):
        value = call[name].default if name in call else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults["guidance_scale"] = float(value)
            break
    sample, factor = getattr(pipeline, "default_sample_size", None), getattr(pipeline, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(factor, int):
        defaults.setdefault("width", sample * factor)
        defaults.setdefault("height", sample * factor)
    return defaults
