"""The served OpenAPI document: the request bodies the routes parse themselves, with exact bounds (FastAPI's
own model makes every integer bound a float), every status each route answers as an `ErrorResponse` (and
not FastAPI's own 422), and the access checks' 403 and 401 as the server is configured."""

from __future__ import annotations

import copy
import json
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from layerstream.server.access import AccessSettings, refusals
from layerstream.server.schemas import ErrorResponse, ImageEditRequest

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# a float holds every integer up to this exactly: a larger integer bound it carries may have been rounded
_EXACT_FLOAT_INTEGERS = 2**53
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_RETRY_AFTER_HEADER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_AUTHENTICATE_HEADER = {"WWW-Authenticate": {"description": "How to authenticate: Bearer.", "schema": {"type": "string"}}}
_HEADERS = {429: _RETRY_AFTER_HEADER, 401: _AUTHENTICATE_HEADER}

QUEUEING_ERRORS = {
    408: "The body came too slowly: 20 s from the end of the head, and 1 s more for every 500 bytes received",
    413: "The body, or its image, is over the server's limits (--max-body-bytes, --max-image-bytes or -pixels)",
    422: "A field is missing, mistyped, out of range or unknown",
    429: "The queue is full",
    503: "The server is shutting down, or a serving rank failed",
}  # every route that queues a generation, besides its 400
IMAGE_INPUT_ERRORS = {
    415: "The input image is not a PNG, JPEG or WebP file (told by its first bytes), or its data URL declares a type"
         " that is neither an image type nor application/octet-stream",
}  # fmt: skip


def error_responses(when: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """``responses`` of a route: each error status it answers (status -> when) with the `ErrorResponse` body."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status, description in when.items():
        responses[status] = {"model": ErrorResponse, "description": description}
        if status in _HEADERS:
            responses[status]["headers"] = _HEADERS[status]
    return responses


def binary_response(description: str, *media_types: str) -> dict[int | str, dict[str, Any]]:
    """``responses`` entry of a route whose 200 is a file (an image, a video) of one of `media_types`."""
    content = {media_type: {"schema": {"type": "string", "format": "binary"}} for media_type in media_types}
    return {200: {"description": description, "content": content}}


def json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that parses its JSON body itself (to bound its size and shape its errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def edit_request_body() -> dict[str, Any]:
    """``openapi_extra`` of the edit form: the image file part and the fields of `ImageEditRequest`."""
    schema = ImageEditRequest.model_json_schema()
    schema["properties"] = {"image": {"type": "string", "format": "binary"}, **schema["properties"]}
    schema["required"] = ["image", *schema.get("required", [])]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def apply_exact_openapi_(app: FastAPI, access: AccessSettings) -> None:
    build = app.openapi  # FastAPI's: builds once per set of routes, then returns the same dict

    def openapi() -> dict[str, Any]:
        built_before = app.openapi_schema
        document = build()
        if document is not built_before:  # built just now: correct it once
            _restore_request_bodies_(document, app)
            _drop_fastapi_validation_errors_(document)
            _restore_integer_bounds_(document)
            _add_access_refusals_(document, access)
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the document


def _restore_request_bodies_(document: dict[str, Any], app: FastAPI) -> None:
    for route in app.routes:
        if not (isinstance(route, APIRoute) and route.include_in_schema and route.openapi_extra):
            continue
        body = route.openapi_extra.get("requestBody")
        if body is None:
            continue
        # the route declares no body parameter, so the request body is all openapi_extra's: replacing it
        # undoes only FastAPI's rounding
        assert route.body_field is None, f"{route.path} has a body parameter and a request body of its own"
        for method in route.methods:
            document["paths"][route.path_format][method.lower()]["requestBody"] = copy.deepcopy(body)


def _add_access_refusals_(document: dict[str, Any], access: AccessSettings) -> None:
    """Each operation's refusals by the access checks, as `ErrorResponse` answers (its own entries kept)."""
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/" + ErrorResponse.__name__}}}
    assert ErrorResponse.__name__ in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            answers = operation.setdefault("responses", {})
            for status, description in refusals(access, method, path).items():
                answer = {"description": description, "content": copy.deepcopy(error_body)}
                if status in _HEADERS:
                    answer["headers"] = copy.deepcopy(_HEADERS[status])
                answers.setdefault(str(status), answer)
            operation["responses"] = dict(sorted(answers.items()))


def _drop_fastapi_validation_errors_(document: dict[str, Any]) -> None:
    """FastAPI's own 422 out of every operation (its path parameters are strings: never answered)."""
    reference = "#/components/schemas/HTTPValidationError"
    for operations in document["paths"].values():
        for operation in operations.values():
            answer = operation.get("responses", {}).get("422", {})
            if answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref") == reference:
                del operation["responses"]["422"]
    if reference in json.dumps(document["paths"]):
        return  # referred to elsewhere too: kept
    schemas = document.get("components", {}).get("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        schemas.pop(name, None)


def _restore_integer_bounds_(node: Any) -> None:
    """Integer bounds elsewhere (response models) back to integers; they are exact below 2**53."""
    if isinstance(node, list):
        for item in node:
            _restore_integer_bounds_(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in _BOUNDS:
            value = node.get(key)
            if isinstance(value, float):
                assert value.is_integer() and abs(value) <= _EXACT_FLOAT_INTEGERS, (
                    f"the integer bound {key}={value!r} may have been rounded: give its schema through openapi_extra"
                )
                node[key] = int(value)
    for value in node.values():
        _restore_integer_bounds_(value)
