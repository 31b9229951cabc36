"""`JsonObject`, a frozen JSON object (a request's ``extra_params``: hashed as the server's batching key, sent to
ranks and into the job history), held as its canonical text and handed out as fresh copies; `first_non_json`; and
`read_json_text`, the one reader of JSON text from strangers. Python's JSON reader and writer recurse once per
level (about 1,000 levels raise `RecursionError`), so text is measured before it is parsed and a value before it
is walked, against `MAX_JSON_DEPTH` and `MAX_JSON_CHARS`.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from layerstream.errors import LayerstreamError

MAX_JSON_DEPTH = 32
"""Levels of arrays and objects one JSON value may nest (a call argument's object: 2; the offload config: 4)."""
MAX_JSON_CHARS = 1 << 20
"""Characters of one JSON text: the server's default body limit (1 MiB); a command line allows less still."""
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
"""A string, or an unclosed one to the end of the text: never a failed match, which would rescan the rest of the
text from every quote (quadratic: a 1 MiB body of escaped quotes held a worker for hours)."""
_BRACKETS = re.compile(r"[\[\]{}]")


class JsonLimitError(LayerstreamError, ValueError):
    """JSON text or a value past `MAX_JSON_DEPTH` or `MAX_JSON_CHARS`; the message names the limit."""


def read_json_text(text: str | bytes) -> Any:
    """The value JSON `text` holds; `JsonLimitError` naming the limit (measured before parsing), or
    `json.JSONDecodeError`."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode()  # UnicodeDecodeError (a ValueError): not UTF-8
    if len(text) > MAX_JSON_CHARS:
        raise JsonLimitError(f"JSON text of {len(text):,} characters is too long; at most {MAX_JSON_CHARS:,}")
    depth = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):  # brackets outside strings
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise JsonLimitError(f"JSON text nests arrays and objects deeper than {MAX_JSON_DEPTH} levels, the limit")
    return json.loads(text)


def check_json_depth(value: Any, path: str) -> None:
    """`JsonLimitError` naming `path` past `MAX_JSON_DEPTH`, walked without recursion (a value built in Python has
    no parser's bound)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, Mapping)):
            if depth >= MAX_JSON_DEPTH:
                raise JsonLimitError(f"{path} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels, the limit")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, Mapping) else item))


def first_non_json(value: Any, path: str) -> tuple[str, Any] | None:
    """(the dotted path, the value) of the first part of `value` (named `path`) that is not a JSON value, or None."""
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
    """A JSON object that cannot change, equal by value and hashable; build it from values `first_non_json` passes."""

    __slots__ = ("_text", "_values")

    def __init__(self, values: Mapping[str, Any] | None = None):
        self._text = json.dumps(dict(values or {}), sort_keys=True, separators=(",", ":"), allow_nan=False)
        self._values: dict[str, Any] = json.loads(self._text)

    def to_dict(self) -> dict[str, Any]:
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
