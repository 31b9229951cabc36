"""`JsonObject`: a frozen JSON object (a request's ``extra_params``), and `first_non_json`, what keeps a value out.

A request is frozen, compared and hashed (its batch shape is the server's batching key), and sent to other
ranks and into the job history; a plain dict would be none of these safely. So the object is held as its
canonical JSON text (keys sorted), which is its identity, and handed out as fresh plain values, which a caller
(or the pipeline that receives them) may change without changing the request.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any


def first_non_json(value: Any, path: str) -> tuple[str, Any] | None:
    """(the dotted path, the value) of the first part of `value` that is not a JSON value (null, a boolean, a
    finite number, a text, an array or an object with text keys), or None if it all is; `path` names `value`."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, (list, tuple)):
        return next((found for i, item in enumerate(value) if (found := first_non_json(item, f"{path}[{i}]"))), None)
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path}.{key!r}", key
            if found := first_non_json(item, f"{path}.{key}"):
                return found
        return None
    return path, value


class JsonObject(Mapping[str, Any]):
    """A JSON object that cannot change: equal to another with the same keys and values, hashable, and read as
    fresh copies (`to_dict`). Build it from values `first_non_json` passes."""

    __slots__ = ("_text", "_values")

    def __init__(self, values: Mapping[str, Any] | None = None):
        self._text = json.dumps(dict(values or {}), sort_keys=True, separators=(",", ":"), allow_nan=False)
        self._values: dict[str, Any] = json.loads(self._text)

    def to_dict(self) -> dict[str, Any]:
        """The object as a new plain dict (nested arrays as lists)."""
        return copy.deepcopy(self._values)

    def __getitem__(self, key: str) -> Any:
        return copy.deepcopy(self._values[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, JsonObject):
            return self._text == other._text
        return isinstance(other, Mapping) and self._values == dict(other)

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"JsonObject({self._text})"

    def __reduce__(self):  # pickled (to other ranks) as its plain values
        return (JsonObject, (self._values,))
