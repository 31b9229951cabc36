"""Serving image-conditioned models: an image (base64) on /v1/videos/generations for tiny-wan-i2v, and
/v1/images/edits (a multipart form, OpenAI's shape) for a tiny Flux Kontext; outputs equal to the resident
pipeline's given the same image; every bad image a 4xx naming the field, never a 500."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from serve_harness import EDITS, IMAGES, VIDEOS, decode_png

PROMPT = "a red fox"
SEED = 3


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def flat_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")  # a few KB; refused from its header
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _resident(model: str, image: bytes, **kwargs):
    """The resident pipeline's output for the same request, encoded as the server encodes it."""
    from layerstream.omni import Omni
    from layerstream.outputs import default_encoding

    omni = Omni(model, device="cpu", offload=False)
    result = omni.generate(PROMPT, image=Image.open(io.BytesIO(image)), seed=SEED, **kwargs)
    return result, base64.b64encode(default_encoding(result.kind).encode(result)).decode("ascii")


# --- image to video: tiny-wan-i2v ------------------------------------------------------------------------------

I2V_IMAGE = png_bytes(50, 35)
I2V_REQUEST = {"prompt": PROMPT, "seed": SEED, "num_frames": 5, "num_inference_steps": 2, "image": b64(I2V_IMAGE)}


@pytest.fixture(scope="module")
def i2v_reference():
    return _frames(_resident("tiny-wan-i2v", I2V_IMAGE, num_frames=5, num_inference_steps=2)[1])


def _frames(b64_mp4: str):
    """An MP4's decoded frames: the server's file and the reference differ in the settings they carry (the
    offload config), not in their frames."""
    from jobs_harness import mp4_frames

    return mp4_frames(base64.b64decode(b64_mp4))


@pytest.fixture(scope="module", params=[["dit"], ["dit", "text_encoder"]], ids="+".join)
def i2v_client(request, server_factory):
    config = json.dumps({"mode": "layer", "components": request.param})
    server = server_factory("tiny-wan-i2v", "--diffusion-offload-config", config, "--max-image-pixels", "1000000")
    with server.client() as client:
        yield client


def test_image_to_video_equals_the_resident_pipeline(i2v_client, i2v_reference):
    response = i2v_client.post(VIDEOS, json=I2V_REQUEST)
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["layerstream"]
    assert (usage["width"], usage["height"], usage["num_frames"]) == (48, 32, 5)
    assert usage["size_note"] == "48x32: the input image's 50x35, rounded down to multiples of 16"
    assert usage["bytes_streamed"] > 0
    # the same frames encode to the same video (libx264 is deterministic): the served video is the resident one
    assert _frames(body["data"][0]["b64_json"]).equal(i2v_reference)
    # also as a data URL
    as_data_url = {**I2V_REQUEST, "image": "data:image/png;base64," + I2V_REQUEST["image"]}
    assert _frames(i2v_client.post(VIDEOS, json=as_data_url).json()["data"][0]["b64_json"]).equal(i2v_reference)


def test_health_says_the_model_needs_an_image(i2v_client):
    health = i2v_client.get("/health").json()
    assert health["image_input"] == "required" and health["max_image_pixels"] == 1_000_000


@pytest.mark.parametrize(
    "image, status, message",
    [
        (None, 400, "image is required"),
        ("", 422, None),  # zero bytes: refused by the schema, naming image
        ("!!not base64!!", 400, "not valid base64"),
        (b64(b"plain text, not an image"), 415, "is not a PNG, JPEG or WebP file"),
        (b64(png_bytes(64, 64)[:80]), 400, "not a readable image"),
        (b64(flat_png(1200, 1000)), 413, "1,200,000 pixels; expected at most 1,000,000"),
        (b64(png_bytes(10, 10)), 400, "less than 16 pixels"),
    ],
    ids=["missing", "empty", "not-base64", "not-an-image", "truncated", "huge", "too-small"],
)
def test_a_bad_image_is_a_4xx_naming_image(i2v_client, image, status, message):
    body = {**I2V_REQUEST, "image": image} if image is not None else {k: v for k, v in I2V_REQUEST.items() if k != "image"}
    response = i2v_client.post(VIDEOS, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "image" or [d["param"] for d in error["details"]] == ["image"]
    if message:
        assert message in error["message"]


def test_the_edit_endpoint_on_a_video_model_is_400(i2v_client):
    response = i2v_client.post(EDITS, files={"image": ("in.png", I2V_IMAGE, "image/png")}, data={"prompt": PROMPT})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "wrong_endpoint_for_model"


# --- image editing: a tiny Flux Kontext, built here ------------------------------------------------------------

EDIT_IMAGE = png_bytes(50, 40)


@pytest.fixture(scope="module")
def edit_client(shared_server, kontext_folder):
    # the default server (its offload config is {"mode": "layer", "components": ["dit"]}): these tests read only
    # their own answers, so the Kontext server other modules start serves them too
    with shared_server(str(kontext_folder)).client() as client:
        yield client


def edit(client, image: bytes | None = EDIT_IMAGE, **fields):
    data = {"prompt": PROMPT, "seed": str(SEED), "num_inference_steps": "2", **fields}
    files = {"image": ("in.png", image, "image/png")} if image is not None else None
    return client.post(EDITS, data=data, files=files)


def test_an_edit_is_the_input_images_size_and_equals_the_resident_pipeline(edit_client, kontext_folder):
    response = edit(edit_client, n="1", response_format="b64_json")
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["layerstream"]
    assert (usage["width"], usage["height"]) == (48, 32)
    assert usage["size_note"] == "48x32: the input image's 50x40, rounded down to multiples of 16"
    served = decode_png(body["data"][0]["b64_json"])
    reference, _ = _resident(str(kontext_folder), EDIT_IMAGE, num_inference_steps=2)
    assert np.array_equal(served, reference.frames[0])  # PNG is lossless: the very pixels


def test_an_edit_at_a_size_asked_for(edit_client):
    response = edit(edit_client, size="32x32")
    assert response.status_code == 200, response.text
    assert decode_png(response.json()["data"][0]["b64_json"]).shape == (32, 32, 3)


def test_health_says_the_model_takes_an_image(edit_client):
    assert edit_client.get("/health").json()["image_input"] == "optional"
    # and it still generates from text alone
    response = edit_client.post(IMAGES, json={"prompt": PROMPT, "size": "32x32", "num_inference_steps": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "kwargs, status, param, message",
    [
        ({"image": None}, 400, "image", "image is required"),
        ({"image": b"not an image"}, 415, "image", "is not a PNG, JPEG or WebP file"),
        ({"image": b""}, 400, "image", "is empty"),
        ({"image": flat_png(5000, 4000)}, 413, "image", "20,000,000 pixels"),
        ({"mask": "x"}, 422, "mask", None),
        ({"n": "two"}, 422, "n", None),
        ({"size": "50x40"}, 400, "size", None),
    ],
    ids=["missing", "not-an-image", "empty", "huge", "unknown-field", "bad-number", "bad-size"],
)
def test_a_bad_edit_is_a_4xx_naming_the_field(edit_client, kwargs, status, param, message):
    response = edit(edit_client, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert param in {error["param"], *(d["param"] for d in error["details"])}
    if message:
        assert message in error["message"]


def test_an_edit_that_is_not_multipart_is_400_naming_the_body(edit_client):
    response = edit_client.post(EDITS, json={"prompt": PROMPT})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    broken = edit_client.post(EDITS, content=b"--x\r\nnonsense", headers={"content-type": "multipart/form-data; boundary=x"})
    assert broken.status_code in (400, 422) and broken.json()["error"]["param"] in ("body", "image")
