"""Error answers: ``{"error": {"message", "type", "param", "code", "details": [...]}}`` for every status (OpenAI's
shape plus ``details``, one entry per problem naming the field and what it accepts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from layerstream.errors import LayerstreamError
from layerstream.wording import first_line
from layerstream.server.schemas import ErrorDetail, ErrorInfo, ErrorResponse

# status -> OpenAI-style error type (others: invalid_request_error below 500, else server_error)
_ERROR_TYPES = {404: "not_found_error", 429: "queue_full_error", 499: "client_closed_request",
                503: "unavailable_error", 504: "timeout_error"}  # fmt: skip


def client_line(error: BaseException, folders: Mapping[str, str] | None = None) -> str:
    """`error` as one line a client may read: no file name, each of `folders` (path -> setting) by its setting."""
    folders = folders or {}
    if isinstance(error, OSError) and error.strerror:
        text = f"{type(error).__name__}: {error.strerror}"
        where = next((setting for folder, setting in folders.items() if str(error.filename or "").startswith(folder)), None)
        text += f" (in {where})" if where else ""
    else:
        text = first_line(error, with_type=True)
    for folder, setting in folders.items():
        text = text.replace(folder, setting)
    return text


class ApiError(LayerstreamError):
    """An answer other than 200: the status, a one-line message, and the field at fault if there is one."""

    def __init__(
        self, status: int, message: str, *, code: str, param: str | None = None, details: Sequence[ErrorDetail] = (),
        headers: Mapping[str, str] | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.details = list(details)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code, details=self.details)
        return ErrorResponse(error=info).model_dump()


def invalid_fields(status: int, details: Sequence[ErrorDetail], *, code: str) -> ApiError:
    """One error for several field problems: the message lists them all, `param` is the first field."""
    message = "; ".join(
        (f"{d.param}: {d.message}" if d.param else d.message) + (f"; allowed: {d.allowed}" if d.allowed else "")
        for d in details
    )
    return ApiError(status, message, code=code, param=details[0].param if details else None, details=details)


def validation_error(error: ValidationError, model: type[BaseModel]) -> ApiError:
    """A 422 naming each bad field and what it accepts; a 400 for a body not JSON, or a bad ``extra_params``."""
    schema = model.model_json_schema()
    properties: dict[str, Any] = schema.get("properties", {})
    details = []
    fields = ", ".join(properties)
    for item in error.errors(include_url=False):
        kind = item["type"]
        loc = [str(part) for part in item["loc"]]
        param = ".".join(loc) if loc else None
        allowed = describe_field(properties.get(loc[0], {})) if loc else None
        if kind == "json_invalid":
            details.append(ErrorDetail(param=None, message=f"the body is not valid JSON ({item['msg']})"))
        elif kind == "model_type" and not loc:
            details.append(ErrorDetail(param=None, message="the body must be a JSON object", allowed=f"fields {fields}"))
        elif kind == "extra_forbidden":
            details.append(ErrorDetail(param=param, message=f"unknown field {loc[0]!r}", allowed=f"fields {fields}"))
        elif kind == "missing":
            details.append(ErrorDetail(param=param, message="is required", allowed=allowed))
        else:
            message = item["msg"]
            if "input" in item:  # say what was sent, not only what is wanted
                message = f"{message}, got {_json_type(item['input'])}"
            details.append(ErrorDetail(param=param, message=message, allowed=allowed))
    if any(item["type"] == "json_invalid" for item in error.errors()):
        return invalid_fields(400, details, code="invalid_json")  # not JSON at all: malformed, not merely invalid
    if any(item["loc"][:1] == ("extra_params",) for item in error.errors()):
        return invalid_fields(400, details, code="invalid_extra_params")
    return invalid_fields(422, details, code="invalid_request_body")


def describe_field(schema: Mapping[str, Any]) -> str | None:
    """What a JSON-schema property accepts, in words ("an integer from 1 to 4", "null or a string ...")."""
    if not schema:
        return None
    options = schema.get("anyOf")
    text = " or ".join(filter(None, map(describe_field, options))) if options else _describe_single(schema)
    if "description" in schema and text:
        text = f"{text} ({schema['description']})"
    return text or None


def _describe_single(schema: Mapping[str, Any]) -> str:
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return "null"
    if kind == "string":
        parts = ["a string"]
        if "pattern" in schema:
            parts.append(f"matching {schema['pattern']}")
        if "minLength" in schema or "maxLength" in schema:
            parts.append(f"of {schema.get('minLength', 0)} to {schema.get('maxLength', 'any number of')} characters")
        return " ".join(parts)
    if kind in ("integer", "number"):
        noun = "an integer" if kind == "integer" else "a number"
        signs = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
        bounds = [f"{sign} {schema[key]}" for key, sign in signs.items() if key in schema]
        return f"{noun} {' and '.join(bounds)}" if bounds else noun
    return str(kind) if kind else ""


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    return {list: "an array", dict: "an object"}.get(type(value), type(value).__name__)
