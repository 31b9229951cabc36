"""Input images are PNG, JPEG or WebP, told by their first bytes before any decoder runs: any other bytes (other
image formats included, which PIL would decode) are one 415 naming the allowed formats. base64 may carry the line
breaks ``base64 FILE`` prints; a data URL's declared type is not trusted: image types and
application/octet-stream are read by their bytes, other types are refused.

Property tests (hypothesis) for the sniffing and the base64 intake; the app runs in this process (FastAPI's test
client) on a stand-in model that takes an optional image."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from layerstream.models.input_image import InputImageError, image_file_format, read_input_image
from layerstream.server.bodies import decode_base64_image
from layerstream.server.errors import ApiError
from test_service import StandInOmni

pytestmark = pytest.mark.fast

MAGIC = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}
# formats PIL decodes (or reaches the decoder of) that the docs do not promise: each must be refused by its bytes
OTHER_FORMATS = ["BMP", "TIFF", "GIF", "ICO", "TGA", "PPM", "PCX", "SGI", "DDS", "JPEG2000"]


def encoded(pixels: np.ndarray, file_format: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=file_format)
    return buffer.getvalue()


def small_pixels(seed: int, width: int = 17, height: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def declared_format(data: bytes) -> str | None:
    """The format by the magic numbers as the formats' own specifications state them (the test's oracle)."""
    for name, magic in MAGIC.items():
        if data.startswith(magic):
            return name
    return "WEBP" if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.sampled_from([*MAGIC.values(), b"RIFF\0\0\0\0WEBP", b"RIFF\0\0\0\0WAVE", b"BM", b"II*\0", b"GIF89a"]).flatmap(
        lambda head: st.binary(max_size=32).map(lambda tail: head + tail)
    ),
))  # fmt: skip
def test_the_format_is_told_by_the_magic_number_alone(data):
    assert image_file_format(data) == declared_format(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64).filter(lambda data: declared_format(data) is None), st.integers(0, 2**16))
def test_bytes_of_no_allowed_format_never_reach_a_decoder(monkeypatch, data, seed):
    def no_decoder(*args, **kwargs):
        raise AssertionError("a decoder ran on bytes of no allowed format")

    monkeypatch.setattr(Image, "open", no_decoder)
    other = encoded(small_pixels(seed), OTHER_FORMATS[seed % len(OTHER_FORMATS)])
    for source in (data, other):
        if not source:
            continue
        with pytest.raises(InputImageError, match="is not a PNG, JPEG or WebP file") as refused:
            read_input_image(source)
        assert refused.value.unsupported_format and not refused.value.too_large


@pytest.mark.parametrize("file_format", ["PNG", "JPEG", "WEBP"])
def test_each_allowed_format_is_read(file_format):
    data = encoded(small_pixels(1), file_format)
    assert image_file_format(data) == file_format
    assert read_input_image(data).size == (17, 9)


def test_an_mpo_is_read_as_the_jpeg_it_starts_with():
    """A camera's MPO is a JPEG with a second picture appended: its bytes say JPEG, and its first picture is read."""
    first, second = Image.fromarray(small_pixels(1)), Image.fromarray(small_pixels(2))
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second])
    assert image_file_format(buffer.getvalue()) == "JPEG"
    assert read_input_image(buffer.getvalue()).size == (17, 9)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.integers(1, 80), st.sampled_from(["\n", "\r\n", " "]))
def test_base64_with_line_breaks_decodes_to_the_same_bytes(data, width, line_break):
    text = base64.b64encode(data).decode()
    wrapped = line_break.join(text[i : i + width] for i in range(0, len(text), width)) + "\n"  # as `base64` prints
    assert decode_base64_image(wrapped) == data
    assert decode_base64_image("data:image/png;base64," + wrapped) == data


@pytest.mark.parametrize("media_type", ["image/png", "image/jpeg", "image/webp", "image/x-anything", "application/octet-stream", "IMAGE/PNG"])
def test_a_data_url_of_an_image_type_or_octet_stream_is_read_by_its_bytes(media_type):
    assert decode_base64_image(f"data:{media_type};base64,AAEC") == b"\0\1\2"


@pytest.mark.parametrize("media_type", ["text/plain", "", "application/pdf", "video/mp4", "text/html;charset=utf-8"])
def test_a_data_url_of_another_type_is_refused_naming_the_allowed_ones(media_type):
    with pytest.raises(ApiError) as refused:
        decode_base64_image(f"data:{media_type};base64,AAEC", "input_reference")
    assert refused.value.status == 415 and refused.value.param == "input_reference"
    assert "image/png, image/jpeg, image/webp" in refused.value.message and "application/octet-stream" in refused.value.message


# --- through the server -----------------------------------------------------------------------------------------


class _EditPipeline:
    def __call__(self, prompt, image=None, height=None, width=None, num_inference_steps=2):  # what limits read
        raise AssertionError("the stand-in Omni never calls its pipeline")


class _EditOmni(StandInOmni):
    def __init__(self) -> None:
        super().__init__()
        from layerstream.models.model_rules import read_model_rules

        self.pipeline = _EditPipeline()
        self.rules = read_model_rules(self.pipeline, self.model)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    service = GenerationService(_EditOmni(), ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path_factory.mktemp("data"))))
    with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
        yield client


JOB = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 1}


@pytest.mark.parametrize("file_format", OTHER_FORMATS)
def test_an_image_of_another_format_is_a_415_on_every_route_that_takes_one(client, file_format):
    data = encoded(small_pixels(3, 32, 32), file_format)
    answers = [
        client.post("/v1/images/jobs", json={**JOB, "image": base64.b64encode(data).decode()}),
        client.post("/v1/images/jobs", data={"prompt": "a fox"}, files={"image": ("in.png", data, "image/png")}),
        client.post("/v1/images/edits", data={"prompt": "a fox"}, files={"image": ("in.png", data, "image/png")}),
    ]
    for response in answers:
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_image_format" and error["param"] == "image"
        assert "is not a PNG, JPEG or WebP file" in error["message"] and "\n" not in error["message"]


def test_base64_as_the_base64_tool_prints_it_is_accepted(client):
    text = base64.encodebytes(encoded(small_pixels(4, 32, 32), "PNG")).decode()  # lines of 76 characters
    assert "\n" in text.strip()
    created = client.post("/v1/images/jobs", json={**JOB, "image": text})
    assert created.status_code == 200, created.text
    as_data_url = client.post("/v1/images/jobs", json={**JOB, "image": "data:application/octet-stream;base64," + text})
    assert as_data_url.status_code == 200, as_data_url.text


def test_a_data_url_declaring_text_is_refused_though_it_holds_a_png(client):
    text = base64.b64encode(encoded(small_pixels(5, 32, 32), "PNG")).decode()
    refused = client.post("/v1/images/jobs", json={**JOB, "image": "data:text/plain;base64," + text})
    assert refused.status_code == 415, refused.text
    assert "'text/plain'" in refused.json()["error"]["message"]
