"""The call arguments a request's ``extra_params`` may set, declared per pipeline family (`FAMILY_ARGUMENTS`).

A stranger's JSON reaches the pipeline's ``__call__`` only through a declaration of the values it takes and what
it adds to the work. Whatever a family does not declare is refused, whatever its annotation: a list ``prompt_2``
runs the text encoder per item, an attention keyword the processor also takes is a crash, a ``sigmas`` of 1e308 a
silently wrong picture.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from layerstream.models.output_limits import MAX_PROMPT_CHARS

_OWN_SEEDS = "n instead (each output with a seed of its own)"
_OWN_OUTPUT = "no such key: layerstream takes the output as arrays and encodes it itself"
_OWN_STEPS = "no such key: layerstream follows the steps itself (progress, previews, stopping)"
_OWN_SIZE = "size (height and width) instead"
SET_BY_LAYERSTREAM = {
    "generator": "seed instead (a generator per output is made from it)",
    "num_videos_per_prompt": _OWN_SEEDS, "num_images_per_prompt": _OWN_SEEDS,
    "output_type": _OWN_OUTPUT, "return_dict": _OWN_OUTPUT,
    "callback_on_step_end": _OWN_STEPS, "callback_on_step_end_tensor_inputs": _OWN_STEPS,
    "max_area": _OWN_SIZE, "_auto_resize": _OWN_SIZE,
}  # fmt: skip
"""Call arguments layerstream sets itself (from no request field), each with what a request gives instead."""

ArgumentKind = Literal["integer", "number", "boolean", "text", "steps", "object"]


@dataclass(frozen=True)
class CallArgument:
    """The JSON values one declared call argument takes, and what it adds to the work."""

    kind: ArgumentKind
    """``"steps"``: an array of numbers, one per step, strictly decreasing, each > `low` and at most `high`."""
    low: float = 0.0
    high: float = 1.0
    """Numbers and integers: from `low` to `high`; step lists: each item above `low`, at most `high`."""
    keys: Mapping[str, CallArgument] | None = None
    """Objects: the keys it may hold, each with what it takes."""
    adds: Literal["text", "tokens"] | None = None
    """Its work: ``"text"`` one more text the encoder reads per prompt; ``"tokens"`` the tokens every text is
    padded to (``max_sequence_length``); None: nothing the price counts."""

    def problem(self, value: Any, num_inference_steps: int) -> str | None:
        """What `value` should be instead (a phrase), or None if it is taken."""
        ok = {
            "integer": lambda: _is_int(value) and self.low <= value <= self.high,
            "number": lambda: _is_number(value) and self.low <= value <= self.high,
            "boolean": lambda: isinstance(value, bool),
            "text": lambda: isinstance(value, str) and len(value) <= MAX_PROMPT_CHARS,
            "steps": lambda: self._is_step_list(value, num_inference_steps),
            "object": lambda: isinstance(value, Mapping) and set(value) <= set(self.keys or {}),
        }[self.kind]()
        if not ok:
            return self.allowed(num_inference_steps)
        if self.kind == "object":
            found = ((key, self.keys[key].problem(item, num_inference_steps)) for key, item in value.items())
            return next((f"{key}: {wrong}" for key, wrong in found if wrong is not None), None)
        return None

    def allowed(self, num_inference_steps: int) -> str:
        return {
            "integer": lambda: f"an integer from {self.low:g} to {self.high:g}",
            "number": lambda: f"a number from {self.low:g} to {self.high:g}",
            "boolean": lambda: "a boolean",
            "text": lambda: f"a text of at most {MAX_PROMPT_CHARS:,} characters",
            "steps": lambda: (
                f"an array of {num_inference_steps} numbers (one per step, num_inference_steps), strictly "
                f"decreasing, each > {self.low:g} and at most {self.high:g}"
            ),
            "object": lambda: "an object with only the keys " + ", ".join(
                f"{key} ({argument.allowed(num_inference_steps)})" for key, argument in (self.keys or {}).items()
            ),
        }[self.kind]()  # fmt: skip

    def _is_step_list(self, value: Any, num_inference_steps: int) -> bool:
        if not isinstance(value, (list, tuple)) or len(value) != num_inference_steps:
            return False
        if not all(_is_number(item) and self.low < item <= self.high for item in value):
            return False
        return all(a > b for a, b in zip(value, value[1:]))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


_TOKENS = CallArgument("integer", 1, 512, adds="tokens")  # high: the call's own default, where it names one
_TEXT = CallArgument("text", adds="text")
# a loaded LoRA's weight: the one key the attention processors do not also take (hidden_states would clash)
_ATTENTION = CallArgument("object", keys={"scale": CallArgument("number", 0.0, 10.0)})
_SIGMAS = CallArgument("steps", 0.0, 1.0)  # flow matching: noise from 1 down towards 0
_TIMESTEPS = CallArgument("steps", 0.0, 1000.0)  # high: the scheduler's num_train_timesteps
_FRACTION = CallArgument("number", 0.0, 1.0)
FAMILY_ARGUMENTS: Mapping[str, Mapping[str, CallArgument]] = {
    "Wan": {"max_sequence_length": _TOKENS, "attention_kwargs": _ATTENTION},
    "Flux": {
        "max_sequence_length": _TOKENS, "prompt_2": _TEXT, "negative_prompt_2": _TEXT, "sigmas": _SIGMAS,
        "joint_attention_kwargs": _ATTENTION,
    },
    "QwenImage": {"max_sequence_length": _TOKENS, "sigmas": _SIGMAS, "attention_kwargs": _ATTENTION},
    "HunyuanVideo": {
        "max_sequence_length": _TOKENS, "prompt_2": _TEXT, "negative_prompt_2": _TEXT, "sigmas": _SIGMAS,
        "attention_kwargs": _ATTENTION,
    },
    "LTX": {
        "max_sequence_length": _TOKENS, "timesteps": _TIMESTEPS, "guidance_rescale": _FRACTION,
        "decode_timestep": _FRACTION, "decode_noise_scale": _FRACTION, "frame_rate": CallArgument("integer", 1, 120),
        "attention_kwargs": _ATTENTION,
    },
    "CogVideoX": {
        "max_sequence_length": _TOKENS, "timesteps": _TIMESTEPS, "use_dynamic_cfg": CallArgument("boolean"),
        "eta": _FRACTION, "attention_kwargs": _ATTENTION,
    },
}  # fmt: skip
"""Per family (the start of the pipeline class's name: ``WanImageToVideoPipeline`` is ``Wan``), the call
arguments ``extra_params`` may set; a pipeline of no family takes none. docs/serving.md has this table."""


def declared_arguments(pipeline: Any) -> dict[str, CallArgument]:
    """Of its family's arguments, those `pipeline`'s ``__call__`` has: ``max_sequence_length`` at most the call's
    default (the encoder's trained length), step lists where its scheduler's ``set_timesteps`` takes them."""
    name = type(pipeline).__name__
    family = max((f for f in FAMILY_ARGUMENTS if name.startswith(f)), key=len, default=None)
    call = inspect.signature(pipeline.__call__).parameters
    scheduler = getattr(pipeline, "scheduler", None)
    set_timesteps = inspect.signature(scheduler.set_timesteps).parameters if hasattr(scheduler, "set_timesteps") else {}
    declared = {}
    for key, argument in (FAMILY_ARGUMENTS[family] if family else {}).items():
        if key not in call or (argument.kind == "steps" and key not in set_timesteps):
            continue
        default = call[key].default
        if argument.adds == "tokens" and _is_int(default) and default >= 1:
            argument = replace(argument, high=default)
        if key == "timesteps":
            argument = replace(argument, high=scheduler.config.get("num_train_timesteps", argument.high))
        declared[key] = argument
    return declared
