"""The served OpenAPI document agrees with the server it describes.

Every bound a request body states, read from ``/openapi.json`` itself, is tried at the bound and one step past
it on each endpoint (and null, where a field is nullable): the document's verdict (jsonschema, the JSON Schema
dialect of OpenAPI 3.1) and the server's (accepted, or refused with 422) must be the same. Accepted requests
name a model that is not served, so they stop at the model checks (400) and nothing is generated. Form fields
of the edit endpoint go as text, null as the text "null", as OpenAPI tools send them.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from PIL import Image
from pydantic import ValidationError

from layerstream.models.output_limits import MAX_SEED
from layerstream.server.errors import validation_error
from layerstream.server.schemas import ImageEditRequest, ImageGenerationRequest, VideoGenerationRequest
from serve_harness import EDITS, IMAGES, VIDEOS

NOT_SERVED = "not-the-served-model"
MULTIPART = "multipart/form-data"
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength")


def png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 80, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


EDIT_IMAGE = png_bytes(50, 40)


@pytest.fixture(scope="module")
def servers(shared_server, kontext_folder) -> dict[str, httpx.Client]:
    """A client per endpoint, each on a server whose model takes that endpoint's requests."""
    models = {IMAGES: "tiny-flux", VIDEOS: "tiny-wan", EDITS: str(kontext_folder)}
    clients = {path: shared_server(model).client() for path, model in models.items()}
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def served_text(servers) -> str:
    response = servers[IMAGES].get("/openapi.json")
    assert response.status_code == 200
    return response.text


@pytest.fixture(scope="module")
def document(served_text) -> dict[str, Any]:
    return json.loads(served_text)  # json keeps 4 an int and 4.0 a float: what a client reads


def request_schema(document: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    (media_type, content), = document["paths"][path]["post"]["requestBody"]["content"].items()
    return media_type, content["schema"]


# --- the document states the bounds the server enforces, exactly ----------------------------------------------


def test_request_bodies_are_served_as_the_request_models_state_them(document):
    assert request_schema(document, IMAGES) == ("application/json", ImageGenerationRequest.model_json_schema())
    assert request_schema(document, VIDEOS) == ("application/json", VideoGenerationRequest.model_json_schema())
    media_type, schema = request_schema(document, EDITS)
    assert media_type == MULTIPART
    form_fields = {name: field for name, field in schema["properties"].items() if name != "image"}
    assert form_fields == ImageEditRequest.model_json_schema()["properties"]
    seed = request_schema(document, IMAGES)[1]["properties"]["seed"]["anyOf"][0]
    assert seed == {"type": "integer", "minimum": 0, "maximum": 2**53 - 1} and MAX_SEED == 2**53 - 1
    for path in (IMAGES, VIDEOS, EDITS):
        Draft202012Validator.check_schema(request_schema(document, path)[1])


def test_every_integer_bound_in_the_document_is_an_integer(document, served_text):
    def integer_bounds(node: Any, where: str):
        if isinstance(node, list):
            for i, item in enumerate(node):
                yield from integer_bounds(item, f"{where}/{i}")
        elif isinstance(node, dict):
            if node.get("type") == "integer":
                yield from ((f"{where}/{k}", node[k]) for k in _BOUND_KEYS if k in node)
            for key, value in node.items():
                yield from integer_bounds(value, f"{where}/{key}")

    bounds = dict(integer_bounds(document, ""))
    assert len(bounds) >= 3 * 6  # n, seed and num_inference_steps on each of the three endpoints, at least
    assert {where: value for where, value in bounds.items() if type(value) is not int} == {}
    assert "9007199254740991" in served_text and "9007199254740991.0" not in served_text


# --- the document and the server give every request the same verdict --------------------------------------------


def values_at_the_bounds(schema: dict[str, Any]) -> list[Any]:
    """Values of a property at each bound its schema states and one step past it, and null if it is nullable."""
    options = schema.get("anyOf", [schema])
    values: list[Any] = [None] if any(o.get("type") == "null" for o in options) else []
    for option in options:
        kind = option.get("type")
        if kind == "integer":
            for key, step in (("minimum", -1), ("exclusiveMinimum", 1), ("maximum", 1), ("exclusiveMaximum", -1)):
                if key in option:
                    values += [option[key], option[key] + step]
        elif kind == "number":
            for key, toward in (("minimum", -math.inf), ("exclusiveMinimum", math.inf), ("maximum", math.inf),
                                ("exclusiveMaximum", -math.inf)):  # fmt: skip
                if key in option:
                    bound = float(option[key])
                    values += [bound, math.nextafter(bound, toward)]
        elif kind == "string":
            for key, step in (("minLength", -1), ("maxLength", 1)):
                if key in option:
                    values += ["x" * length for length in (option[key], option[key] + step) if length >= 0]
    return values


def form_text(value: Any) -> str:
    """How a tool sends a value as a form field: the JSON text of a number or null, a string as it is."""
    return value if isinstance(value, str) else json.dumps(value)


def send(client: httpx.Client, path: str, media_type: str, fields: dict[str, Any]) -> httpx.Response:
    if media_type == MULTIPART:
        data = {name: form_text(value) for name, value in fields.items()}
        return client.post(path, data=data, files={"image": ("in.png", EDIT_IMAGE, "image/png")})
    return client.post(path, json=fields)


@pytest.mark.parametrize("path", [IMAGES, VIDEOS, EDITS])
def test_the_document_and_the_server_agree_at_every_bound(servers, document, path):
    media_type, schema = request_schema(document, path)
    validator = Draft202012Validator(schema)
    base = {"prompt": "a red fox", "model": NOT_SERVED}
    placeholder = {"image": "(the image file)"} if media_type == MULTIPART else {}
    tried: dict[str, set[bool]] = {}
    disagreements = []
    for name, property_schema in schema["properties"].items():
        for value in values_at_the_bounds(property_schema):
            fields = {**base, name: value}
            document_accepts = validator.is_valid({**placeholder, **fields})
            response = send(servers[path], path, media_type, fields)
            if response.status_code == 422:
                # refused naming the field, the value seen and what it takes
                error = response.json()["error"]
                assert error["param"] == name and "got " in error["message"], response.text
                assert error["details"][0]["allowed"], response.text
            elif fields["model"] == NOT_SERVED:  # through the schema, stopped at the model checks (400)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["code"] == "invalid_for_model", response.text
            else:  # model null: the served model, generated
                assert response.status_code == 200, response.text
            if document_accepts != (response.status_code != 422):
                shown = value if not isinstance(value, str) or len(value) < 20 else f"{len(value)} characters"
                verdicts = f"document accepts: {document_accepts}, server: {response.status_code}"
                disagreements.append(f"{name}={shown!r}: {verdicts}")
            tried.setdefault(name, set()).add(document_accepts)
    assert disagreements == []
    # the values straddle each bound: every bounded field was both accepted and refused
    bounded = {name for name, verdicts in tried.items() if verdicts == {True, False}}
    expected = {"prompt", "negative_prompt", "n", "seed", "num_inference_steps", "guidance_scale", "timeout"}
    assert bounded >= expected | ({"num_frames", "fps"} if path == VIDEOS else set())


# --- a form has no null: the text "null" (and empty text where no value is empty) is absent ----------------------


@pytest.mark.parametrize(
    "name, text, expected",
    [
        *[(name, text, None) for name in ("seed", "num_inference_steps", "guidance_scale", "timeout", "size")
          for text in ("null", "")],
        ("model", "null", None), ("negative_prompt", "null", None),
        ("model", "", ""), ("negative_prompt", "", ""),  # free text: empty text is a value, kept as given
    ],
)  # fmt: skip
def test_a_form_null_is_absent(name, text, expected):
    assert getattr(ImageEditRequest.model_validate({"prompt": "fox", name: text}), name) == expected


def test_a_form_null_for_a_field_that_takes_no_null_is_refused_naming_it():
    with pytest.raises(ValidationError) as info:
        ImageEditRequest.model_validate({"prompt": "fox", "n": "null"})
    error = validation_error(info.value, ImageEditRequest)
    assert error.status == 422 and error.param == "n" and "got the string 'null'" in error.message


def test_an_edit_with_every_nullable_field_null_runs_with_the_defaults(servers):
    nullable = [name for name, s in ImageEditRequest.model_json_schema()["properties"].items() if "anyOf" in s]
    assert set(nullable) >= {"seed", "size", "num_inference_steps", "guidance_scale", "timeout", "model"}
    data = {"prompt": "a red fox", **{name: "null" for name in nullable}}
    response = servers[EDITS].post(EDITS, data=data, files={"image": ("in.png", EDIT_IMAGE, "image/png")})
    assert response.status_code == 200, response.text
    usage = response.json()["layerstream"]
    assert (usage["width"], usage["height"]) == (48, 32)  # the input image's size, as without size
    # and what httpx sends for None (empty text): absent too, for every field that takes no empty text
    data = {"prompt": "a red fox", "seed": None, "size": None, "timeout": None, "num_inference_steps": "1"}
    response = servers[EDITS].post(EDITS, data=data, files={"image": ("in.png", EDIT_IMAGE, "image/png")})
    assert response.status_code == 200, response.text
    assert response.json()["layerstream"]["num_inference_steps"] == 1
