"""The served OpenAPI document: the request bodies the routes parse themselves, and their bounds kept exact.

FastAPI passes the document it builds through its own `OpenAPI` model, whose ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum`` and ``multipleOf`` are floats: every integer bound comes out a
float (``n`` from 1.0 to 4.0) and ``seed``'s 2**64 - 1 is rounded to 2**64, one past what the server takes,
so tools that validate against the document send requests the server refuses. `apply_exact_openapi_`
puts the request bodies back, as the request models state them, after that pass, and turns any other
integer bound back into an integer.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from layerstream.server.schemas import ImageEditRequest

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# a float holds every integer up to this exactly: a larger integer bound it carries may have been rounded
_EXACT_FLOAT_INTEGERS = 2**53


def json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that parses its JSON body itself (to bound its size and shape its errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def edit_request_body() -> dict[str, Any]:
    """``openapi_extra`` of the edit form: the image file part and the fields of `ImageEditRequest`."""
    schema = ImageEditRequest.model_json_schema()
    schema["properties"] = {"image": {"type": "string", "format": "binary"}, **schema["properties"]}
    schema["required"] = ["image", *schema.get("required", [])]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def apply_exact_openapi_(app: FastAPI) -> None:
    """Make `app` serve its OpenAPI document with the request bodies of its routes' ``openapi_extra`` as
    given, and every integer bound an integer."""
    build = app.openapi  # FastAPI's: builds once per set of routes, then returns the same dict

    def openapi() -> dict[str, Any]:
        built_before = app.openapi_schema
        document = build()
        if document is not built_before:  # built just now: correct it once
            _restore_request_bodies_(document, app)
            _restore_integer_bounds_(document)
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
