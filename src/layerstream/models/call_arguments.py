"""What a pipeline's call takes from JSON: the keys a request's ``extra_params`` may set, and their checks.

Read once from the pipeline's ``__call__`` signature (`read_call_arguments`): each parameter's annotation says
which JSON values it takes (``int``: an integer, ``list[float]``: an array of numbers, ``dict``: an object, a
union any of its members'). A parameter that takes only tensors, images, generators or callables cannot come
from JSON and is left out, as are the arguments layerstream sets, from a request's fields or itself
(`FROM_REQUEST_FIELDS`, `SET_BY_LAYERSTREAM`; the request refuses them as keys, `request.EXTRA_PARAMS_REFUSED`).
Two rules keep a passed argument within what the server prices: a step list (``sigmas``, ``timesteps``: the
pipeline then runs one step per item) has one item per step, and ``max_sequence_length`` is at most the call's
default (the text encoder's trained length; more pads every prompt to it).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
FROM_REQUEST_FIELDS = (
    "prompt", "negative_prompt", "image", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
    "guidance_scale_2", "true_cfg_scale",
)  # fmt: skip
"""Call arguments layerstream sets from a request's fields of the same names (`pipeline_runner`)."""

JsonKind = Literal["null", "boolean", "integer", "number", "string", "array", "object"]
_SCALAR_KINDS: dict[Any, JsonKind] = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
_KIND_WORDS = {
    "null": "null", "boolean": "a boolean", "integer": "an integer", "number": "a number", "string": "a text",
    "array": "an array", "object": "a JSON object",
}  # fmt: skip
STEP_LISTS = ("sigmas", "timesteps")
"""Arguments the pipeline runs one step per item of: they must have the request's step count."""
CAPPED_BY_DEFAULT = ("max_sequence_length",)
"""Integer arguments at most the call's own default (which is at least 1)."""


@dataclass(frozen=True)
class JsonArgument:
    """The JSON values one call argument takes."""

    kinds: frozenset[JsonKind]
    items: JsonArgument | None = None
    """Arrays: what each item takes (None: any JSON value)."""
    most: int | None = None
    """Integers: the largest taken, from 1 (`CAPPED_BY_DEFAULT`); None: no bound."""

    def admits(self, value: Any) -> bool:
        kind = _kind_of(value)
        if kind not in self.kinds and not (kind == "integer" and "number" in self.kinds):
            return False
        if kind == "integer" and self.most is not None and "number" not in self.kinds:
            return 1 <= value <= self.most
        if kind == "array" and self.items is not None:
            return all(self.items.admits(item) for item in value)
        return True

    def allowed(self) -> str:
        """What it takes, as a phrase: ``"an integer from 1 to 512"``, ``"a number or an array (each item a number)"``."""
        words = []
        for kind in sorted(self.kinds, key=list(_KIND_WORDS).index):
            word = _KIND_WORDS[kind]
            if kind == "integer" and self.most is not None:
                word += f" from 1 to {self.most}"
            if kind == "array" and self.items is not None:
                word += f" (each item {self.items.allowed()})"
            words.append(word)
        return " or ".join(words)


ANY_JSON = JsonArgument(frozenset(typing.get_args(JsonKind)))


def read_call_arguments(pipeline: Any) -> dict[str, JsonArgument]:
    """Each argument of `pipeline`'s ``__call__`` a JSON value can set, by name, but those layerstream sets
    (`FROM_REQUEST_FIELDS`, `SET_BY_LAYERSTREAM`)."""
    refused = {*FROM_REQUEST_FIELDS, *SET_BY_LAYERSTREAM}
    call = pipeline.__call__
    arguments = {}
    for name, parameter in inspect.signature(call).parameters.items():
        if name in refused or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = _resolved(call, parameter.annotation)
        taken = ANY_JSON if annotation is parameter.empty else _from_annotation(annotation)
        if taken is None or taken.kinds <= {"null"}:
            continue  # tensors, images, generators, callables: nothing JSON can give but null
        default = parameter.default
        if name in CAPPED_BY_DEFAULT and isinstance(default, int) and not isinstance(default, bool) and default >= 1:
            taken = JsonArgument(taken.kinds, taken.items, most=default)
        arguments[name] = taken
    return arguments


def argument_problem(name: str, argument: JsonArgument, value: Any, num_inference_steps: int) -> str | None:
    """What `value` should be instead, if `argument` (call argument `name`) cannot take it; else None."""
    if not argument.admits(value):
        return argument.allowed()
    if name in STEP_LISTS and isinstance(value, list) and len(value) != num_inference_steps:
        return f"{argument.allowed()}, with one item per step ({num_inference_steps}, num_inference_steps)"
    return None


def _resolved(call: Any, annotation: Any) -> Any:
    """`annotation` as a type: a string one (``from __future__ import annotations``) evaluated in the call's
    module, as `typing.get_type_hints` does, but one parameter at a time (None: it names what is not there)."""
    if not isinstance(annotation, str):
        return annotation
    try:
        # the names of the pipeline's own module, as get_type_hints reads them (unwrapped: torch.no_grad's wrapper
        # function has torch's)
        return eval(annotation, getattr(inspect.unwrap(call), "__globals__", {}))
    except Exception:
        return None  # its parameter is left out


def _kind_of(value: Any) -> JsonKind | None:
    if isinstance(value, bool) or value is None or type(value) in _SCALAR_KINDS:
        return _SCALAR_KINDS[type(value)]
    if isinstance(value, (list, tuple)):
        return "array"
    return "object" if isinstance(value, Mapping) else None


def _from_annotation(annotation: Any) -> JsonArgument | None:
    """The JSON values an annotation takes (None: none)."""
    if annotation is Any or annotation is object:
        return ANY_JSON
    if annotation in _SCALAR_KINDS:
        return JsonArgument(frozenset({_SCALAR_KINDS[annotation]}))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _union([_from_annotation(arg) for arg in args])
    if origin is Literal:
        return _union([JsonArgument(frozenset({kind})) for arg in args if (kind := _kind_of(arg)) is not None])
    if annotation in (list, tuple) or origin in (list, tuple, Sequence, MutableSequence):
        items = [arg for arg in args if arg is not Ellipsis]
        item = _union([_from_annotation(arg) for arg in items]) if items else ANY_JSON
        return JsonArgument(frozenset({"array"}), item) if item is not None else None
    if annotation in (dict, Mapping) or origin in (dict, Mapping):
        return JsonArgument(frozenset({"object"}))
    return None  # a class of its own: a tensor, an image, a generator, a callable


def _union(members: list[JsonArgument | None]) -> JsonArgument | None:
    taken = [member for member in members if member is not None]
    if not taken:
        return None
    kinds = frozenset().union(*(member.kinds for member in taken))
    items = _union([member.items for member in taken if "array" in member.kinds and member.items is not None])
    return JsonArgument(kinds, items)
