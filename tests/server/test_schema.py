"""The HTTP contract, frozen: request schemas, response and health keys, and the shape of error answers.

A failure here means the API changed. If that was deliberate, update the literals in `serve_contract` in the
same change (and say so to API users); if not, the change is a bug.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from layerstream.server.errors import validation_error
from layerstream.server.schemas import (
    ErrorResponse,
    GenerationUsage,
    HealthResponse,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    VideoData,
    VideoGenerationRequest,
    VideoGenerationResponse,
)
from serve_contract import (
    ERROR_KEYS,
    HEALTH_KEYS,
    IMAGE_DATA_KEYS,
    IMAGE_REQUEST_CONTRACT,
    IMAGE_RESPONSE_KEYS,
    RESPONSE_KEYS,
    USAGE_KEYS,
    VIDEO_DATA_KEYS,
    VIDEO_REQUEST_CONTRACT,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def contract(model) -> dict:
    """The parts of a JSON schema clients rely on: fields, types, bounds, defaults (not titles or prose)."""
    schema = model.model_json_schema()

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("title", "description")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return {
        "required": schema["required"],
        "additionalProperties": schema["additionalProperties"],
        "properties": strip(schema["properties"]),
    }


def test_request_schemas_are_frozen():
    assert contract(ImageGenerationRequest) == IMAGE_REQUEST_CONTRACT
    assert contract(VideoGenerationRequest) == VIDEO_REQUEST_CONTRACT


def test_response_schemas_are_frozen():
    assert list(ImageGenerationResponse.model_fields) == IMAGE_RESPONSE_KEYS
    assert list(VideoGenerationResponse.model_fields) == RESPONSE_KEYS
    assert list(ImageData.model_fields) == IMAGE_DATA_KEYS
    assert list(VideoData.model_fields) == VIDEO_DATA_KEYS
    assert list(GenerationUsage.model_fields) == USAGE_KEYS
    assert list(HealthResponse.model_fields) == HEALTH_KEYS
    assert list(ErrorResponse.model_fields["error"].annotation.model_fields) == ERROR_KEYS


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": "fox", "n": "2"}',  # a number as a string
        '{"prompt": "fox", "n": 2.0}',  # a float for an int
        '{"prompt": "fox", "seed": true}',  # a boolean for an int
        '{"prompt": "fox", "guidance_scale": "3"}',
        '{"prompt": 7}',
    ],
)
def test_types_are_strict(body):
    with pytest.raises(ValidationError):
        ImageGenerationRequest.model_validate_json(body)


def test_validation_errors_name_the_field_and_what_it_accepts():
    with pytest.raises(ValidationError) as info:
        VideoGenerationRequest.model_validate_json('{"n": 9, "colour": "red", "fps": "x"}')
    error = validation_error(info.value, VideoGenerationRequest)
    assert error.status == 422
    by_param = {d.param: d for d in error.details}
    assert set(by_param) == {"prompt", "n", "colour", "fps"}
    assert by_param["prompt"].message == "is required"
    assert "<= 4" in by_param["n"].allowed and ">= 1" in by_param["n"].allowed
    assert "unknown field 'colour'" in by_param["colour"].message and "num_frames" in by_param["colour"].allowed
    assert "got the string 'x'" in by_param["fps"].message
    body = error.body()["error"]
    assert list(body) == ERROR_KEYS and body["param"] == error.details[0].param
    assert all(d.param in body["message"] for d in error.details)


def test_not_json_is_400_and_not_an_object_is_422():
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate_json("{prompt")
    assert validation_error(info.value, ImageGenerationRequest).status == 400
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate_json("[1, 2]")
    error = validation_error(info.value, ImageGenerationRequest)
    assert error.status == 422 and "JSON object" in error.message
