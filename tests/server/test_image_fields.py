"""OpenAI's image fields, sent by OpenAI's own client where it helps: response_format "url", output_format,
output_compression, quality and user, size "auto", image[] lists on edits and a refused mask."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from layerstream.server.image_outputs import KeptOutputs
from serve_harness import EDITS, IMAGES, decode_png

openai = pytest.importorskip("openai")

PROMPT = "a red fox"
SMALL = {"size": "32x32", "num_inference_steps": 1, "seed": 7}


def encode_image(png: bytes, output_format: str, compression: int | None = None) -> bytes:
    """The reference: the PNG's pixels, encoded by Pillow as `output_format` (quality 100 unless given)."""
    with Image.open(io.BytesIO(png)) as image:
        encoded = io.BytesIO()
        image.convert("RGB").save(encoded, format=output_format.upper(), quality=100 if compression is None else compression)
    return encoded.getvalue()


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server("tiny-flux")


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def png_reference(client) -> bytes:
    """The PNG of the request every other format is checked against."""
    response = client.post(IMAGES, json={"prompt": PROMPT, **SMALL})
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def test_a_url_answer_serves_the_same_png(openai_client, png_reference):
    answer = openai_client.images.generate(prompt=PROMPT, response_format="url", extra_body=SMALL)
    assert answer.data[0].b64_json is None
    fetched = httpx.get(answer.data[0].url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert fetched.content == png_reference  # the very file the b64_json answer holds
    assert answer.output_format == "png" and answer.size == "32x32"


def test_an_unknown_output_url_is_404_saying_how_long_outputs_are_kept(client):
    response = client.get("/v1/images/outputs/img_0123.png")
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "kept in memory" in message and "256" in message


@pytest.mark.parametrize("output_format, compression", [("jpeg", None), ("jpeg", 40), ("webp", 80)])
def test_output_format_is_the_png_encoded_again(openai_client, png_reference, output_format, compression):
    fields = {} if compression is None else {"output_compression": compression}
    answer = openai_client.images.generate(
        prompt=PROMPT, output_format=output_format, response_format="b64_json", extra_body=SMALL, **fields
    )
    data = base64.b64decode(answer.data[0].b64_json)
    assert data == encode_image(png_reference, output_format, compression)  # pixels as the PNG's, then encoded
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == output_format.upper() and image.size == (32, 32)
    assert answer.output_format == output_format


def test_output_compression_changes_the_file(png_reference):
    assert len(encode_image(png_reference, "jpeg", 10)) < len(encode_image(png_reference, "jpeg", 95))


def test_quality_and_user_are_accepted_and_logged_without_effect(server, client, png_reference):
    response = client.post(IMAGES, json={"prompt": PROMPT, **SMALL, "quality": "high", "user": "user-1234"})
    assert response.status_code == 200, response.text
    assert base64.b64decode(response.json()["data"][0]["b64_json"]) == png_reference
    assert "user 'user-1234', quality 'high'" in server.log()


def test_size_auto_is_the_models_default(client):
    fields = {"prompt": PROMPT, "num_inference_steps": 1, "seed": 7}
    auto = client.post(IMAGES, json={**fields, "size": "auto"})
    default = client.post(IMAGES, json=fields)
    assert auto.status_code == default.status_code == 200, auto.text
    assert auto.json()["size"] == default.json()["size"] == client.get("/health").json()["default_size"]
    assert np.array_equal(decode_png(auto.json()["data"][0]["b64_json"]), decode_png(default.json()["data"][0]["b64_json"]))


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("output_format", "gif", "'png', 'jpeg', 'webp'"),
        ("output_compression", 101, "100"),
        ("response_format", "file", "'b64_json', 'url'"),
        ("quality", "ultra", "'auto'"),
        ("size", "big", "auto"),
    ],
)
def test_a_bad_image_field_is_a_422_naming_it(client, field, value, allowed):
    response = client.post(IMAGES, json={"prompt": PROMPT, field: value})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == field and str(value) in error["message"]
    assert allowed in error["details"][0]["allowed"], error


def test_kept_outputs_drop_the_oldest_past_either_bound():
    kept = KeptOutputs(max_outputs=3, max_bytes=100)
    a, b, c, d = (kept.put(bytes([i]) * 30, "png") for i in range(4))
    assert [kept.get(name) is not None for name in (a, b, c, d)] == [False, True, True, True]  # past the count
    e = kept.put(b"e" * 60, "webp")  # b goes for the count, c for the bytes (120 > 100)
    assert [kept.get(name) is not None for name in (b, c, d, e)] == [False, False, True, True]
    assert kept.get(e).media_type == "image/webp"
    huge = kept.put(b"y" * 500, "jpeg")  # over the bound by itself: kept, alone, so that its URL answers
    assert kept.get(d) is None and kept.get(e) is None and kept.get(huge).data == b"y" * 500


# --- edits: image[] lists and masks, with a tiny Flux Kontext --------------------------------------------------


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


EDIT_IMAGE = _png(32, 32, 0)
EDIT_FIELDS = {"num_inference_steps": 1, "seed": 3}


@pytest.fixture(scope="module")
def edit_server(shared_server, kontext_folder):
    return shared_server(str(kontext_folder))


@pytest.fixture(scope="module")
def edit_openai(edit_server):
    with openai.OpenAI(base_url=edit_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _edit(client, image, **fields):
    answer = client.images.edit(image=image, prompt=PROMPT, response_format="b64_json", extra_body=EDIT_FIELDS, **fields)
    return base64.b64decode(answer.data[0].b64_json)


def test_an_image_list_of_one_is_that_image(edit_openai):
    alone = _edit(edit_openai, ("in.png", EDIT_IMAGE, "image/png"))
    listed = _edit(edit_openai, [("in.png", EDIT_IMAGE, "image/png")])
    assert listed == alone


def test_two_images_are_a_422_naming_image(edit_openai):
    images = [("a.png", EDIT_IMAGE, "image/png"), ("b.png", _png(32, 32, 1), "image/png")]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _edit(edit_openai, images)
    error = info.value.response.json()["error"]
    assert error["param"] == "image" and "got 2 images" in error["message"] and "takes one" in error["message"]


def test_a_mask_is_a_422_naming_mask(edit_openai, edit_server):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _edit(edit_openai, ("in.png", EDIT_IMAGE, "image/png"), mask=("mask.png", _png(32, 32, 2), "image/png"))
    error = info.value.response.json()["error"]
    assert error["param"] == "mask" and "mask is not supported" in error["message"]
    with httpx.Client(base_url=edit_server.url) as client:  # a mask as a text field: the same answer
        response = client.post(EDITS, data={"prompt": PROMPT, "mask": "x"}, files={"image": ("in.png", EDIT_IMAGE)})
    assert response.status_code == 422 and response.json()["error"]["param"] == "mask"


def test_an_edit_as_a_jpeg_url(edit_openai):
    answer = edit_openai.images.edit(
        image=("in.png", EDIT_IMAGE, "image/png"), prompt=PROMPT, response_format="url", output_format="jpeg",
        size="auto", extra_body=EDIT_FIELDS,
    )  # fmt: skip
    fetched = httpx.get(answer.data[0].url)
    assert fetched.headers["content-type"] == "image/jpeg"
    png = _edit(edit_openai, ("in.png", EDIT_IMAGE, "image/png"))
    assert fetched.content == encode_image(png, "jpeg")
    assert answer.size == "32x32"  # auto: the input image's size
