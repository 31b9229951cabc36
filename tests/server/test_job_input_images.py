"""The input image of a job, sent as a multipart file: `input_reference` on ``POST /v1/videos`` for tiny-wan-i2v
(through OpenAI's own client) and `image` on ``POST /v1/images/jobs`` for a tiny Flux Kontext (raw multipart:
OpenAI's client has no image jobs). A job's output is bit-identical to the synchronous endpoint's (and the
resident pipeline's) for the same image and settings; an image the model does not take, a missing one it
needs, and a file that is not an image are each one 4xx naming the field the client sent. (Kontext's image is
optional: without one, a job is text to image, as on the generation endpoint.)"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from layerstream.server.errors import ApiError

from jobs_harness import IMAGE_JOBS, VIDEOS, mp4_frames, openai_client, png_pixels, wait_for_job
from serve_harness import EDITS, IMAGES
from serve_harness import VIDEOS as SYNC_VIDEOS

PROMPT = "a red fox"
SEED = 3
STEPS = 2
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client marks videos so


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def resident_frames(model: str, image: bytes, **kwargs) -> torch.Tensor:
    """The resident pipeline's frames for the same request, through the server's encoding (MP4 or PNG) and
    back, as a job's output is read."""
    from layerstream.omni import Omni
    from layerstream.outputs import default_encoding

    result = Omni(model, device="cpu", offload=False).generate(
        PROMPT, image=Image.open(io.BytesIO(image)), seed=SEED, num_inference_steps=STEPS, **kwargs
    )
    encoded = default_encoding(result.kind).encode(result)
    return mp4_frames(encoded) if encoded[4:8] == b"ftyp" else png_pixels(encoded)


def multipart_form(fields: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """A multipart form of text fields only (httpx sends such fields URL-encoded unless a file goes with them)."""
    boundary = "layerstream-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n' for name, value in fields.items()]
    body = ("".join(parts) + f"--{boundary}--\r\n").encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


def assert_one_error_naming(response, status: int, field: str, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    assert words in error["message"] and field in error["message"], error


# --- image to video: input_reference on /v1/videos --------------------------------------------------------------

I2V_IMAGE = png_bytes(50, 35)
I2V_FIELDS = {"seed": SEED, "num_inference_steps": STEPS, "num_frames": 5}


@pytest.fixture(scope="module")
def i2v_server(server_factory):
    return server_factory("tiny-wan-i2v")


def test_input_reference_from_openais_client_equals_the_synchronous_endpoint_and_omni(i2v_server, tmp_path):
    image_file = tmp_path / "fox.png"
    image_file.write_bytes(I2V_IMAGE)
    client = openai_client(i2v_server)
    with open(image_file, "rb") as input_reference:
        video = client.videos.create(prompt=PROMPT, input_reference=input_reference, extra_body=I2V_FIELDS)
    assert video.layerstream["settings"]["has_input_image"] is True
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed", done.error
    assert done.size == "48x32"  # the input image's 50x35, rounded down to multiples of 16
    job_frames = mp4_frames(client.videos.download_content(video.id).content)

    with i2v_server.client() as http:
        image_b64 = base64.b64encode(I2V_IMAGE).decode("ascii")
        sync = http.post(SYNC_VIDEOS, json={"prompt": PROMPT, "image": image_b64, **I2V_FIELDS})
    assert sync.status_code == 200, sync.text
    sync_frames = mp4_frames(base64.b64decode(sync.json()["data"][0]["b64_json"]))
    assert tuple(job_frames.shape) == (5, 32, 48, 3)
    assert torch.equal(job_frames, sync_frames)
    assert torch.equal(job_frames, resident_frames("tiny-wan-i2v", I2V_IMAGE, num_frames=5))


def test_a_missing_input_reference_is_one_400_naming_it(i2v_server):
    import openai

    client = openai_client(i2v_server)
    jobs_before = client.videos.list(limit=100).data
    with pytest.raises(openai.BadRequestError) as raised:
        client.videos.create(prompt=PROMPT, extra_body=I2V_FIELDS)  # a multipart form without the file
    assert_one_error_naming(raised.value.response, 400, "input_reference", "is required")
    with i2v_server.client() as http:
        assert_one_error_naming(http.post(VIDEOS, json={"prompt": PROMPT}), 400, "input_reference", "is required")
    assert client.videos.list(limit=100).data == jobs_before  # nothing stored


def test_an_input_reference_that_is_not_an_image_is_one_4xx_naming_it(i2v_server):
    with i2v_server.client() as http:
        files = {"input_reference": ("notes.txt", b"plain text, not an image", "text/plain")}
        response = http.post(VIDEOS, data={"prompt": PROMPT}, files=files)
        assert_one_error_naming(response, 415, "input_reference", "not a PNG, JPEG or WebP file")
        truncated = {"input_reference": ("fox.png", I2V_IMAGE[:80], "image/png")}
        assert_one_error_naming(http.post(VIDEOS, data={"prompt": PROMPT}, files=truncated), 400, "input_reference", "not a readable image")
        too_small = {"input_reference": ("dot.png", png_bytes(10, 10), "image/png")}
        assert_one_error_naming(http.post(VIDEOS, data={"prompt": PROMPT}, files=too_small), 400, "input_reference", "less than 16 pixels")


def test_input_reference_as_text_is_one_422_naming_it(i2v_server):
    with i2v_server.client() as http:
        body, headers = multipart_form({"prompt": PROMPT, "input_reference": "fox.png"})
        response = http.post(VIDEOS, content=body, headers=headers)
        assert_one_error_naming(response, 422, "input_reference", "file part")


def test_input_reference_on_a_model_that_takes_no_image_is_one_400_naming_it(shared_server):
    server = shared_server("tiny-wan")
    client = openai_client(server)
    import openai

    jobs_before = client.videos.list(limit=100).data
    with pytest.raises(openai.BadRequestError) as raised:
        client.videos.create(prompt=PROMPT, input_reference=("fox.png", I2V_IMAGE, "image/png"), extra_body=I2V_FIELDS)
    assert_one_error_naming(raised.value.response, 400, "input_reference", "takes no input image")
    assert client.videos.list(limit=100).data == jobs_before  # nothing stored


# --- image editing: image on /v1/images/jobs ----------------------------------------------------------------------

EDIT_IMAGE = png_bytes(50, 40, seed=1)
EDIT_FIELDS = {"prompt": PROMPT, "seed": str(SEED), "num_inference_steps": str(STEPS)}


@pytest.fixture(scope="module")
def edit_server(shared_server, kontext_folder):
    return shared_server(str(kontext_folder))


def test_an_image_job_equals_the_edit_endpoint_and_omni(edit_server, kontext_folder):
    with edit_server.client() as http:
        created = http.post(IMAGE_JOBS, data=EDIT_FIELDS, files={"image": ("cat.png", EDIT_IMAGE, "image/png")})
        assert created.status_code == 200, created.text
        assert created.json()["layerstream"]["settings"]["has_input_image"] is True
        done = wait_for_job(http, IMAGE_JOBS, created.json()["id"])
        assert done["status"] == "completed", done
        assert done["size"] == "48x32"  # the input image's 50x40, rounded down to multiples of 16
        job_pixels = png_pixels(http.get(f"{IMAGE_JOBS}/{done['id']}/content").content)
        edit = http.post(EDITS, data=EDIT_FIELDS, files={"image": ("cat.png", EDIT_IMAGE, "image/png")})
        assert edit.status_code == 200, edit.text
        edit_pixels = png_pixels(base64.b64decode(edit.json()["data"][0]["b64_json"]))
        # OpenAI's client sends a list of images as image[]: a list of one is that image
        listed = http.post(IMAGE_JOBS, data=EDIT_FIELDS, files={"image[]": ("cat.png", EDIT_IMAGE, "image/png")})
        assert listed.status_code == 200, listed.text
        listed_pixels = png_pixels(http.get(f"{IMAGE_JOBS}/{wait_for_job(http, IMAGE_JOBS, listed.json()['id'])['id']}/content").content)
    assert tuple(job_pixels.shape) == (32, 48, 3)
    assert torch.equal(job_pixels, edit_pixels)
    assert torch.equal(job_pixels, listed_pixels)
    assert torch.equal(job_pixels, resident_frames(str(kontext_folder), EDIT_IMAGE))


def test_without_an_image_kontext_makes_the_generation_endpoints_image(edit_server):
    """Flux Kontext takes an optional image (``image_input`` optional): a job without one is text to image."""
    fields = {**EDIT_FIELDS, "size": "32x32"}
    with edit_server.client() as http:
        assert http.get("/health").json()["image_input"] == "optional"
        body, headers = multipart_form(fields)  # as a browser's FormData sends it, without the file
        created = http.post(IMAGE_JOBS, content=body, headers=headers)
        assert created.status_code == 200, created.text
        assert created.json()["layerstream"]["settings"]["has_input_image"] is False
        done = wait_for_job(http, IMAGE_JOBS, created.json()["id"])
        assert done["status"] == "completed", done
        job_pixels = png_pixels(http.get(f"{IMAGE_JOBS}/{done['id']}/content").content)
        sync = http.post(IMAGES, json={"prompt": PROMPT, "seed": SEED, "num_inference_steps": STEPS, "size": "32x32"})
        assert sync.status_code == 200, sync.text
    assert torch.equal(job_pixels, png_pixels(base64.b64decode(sync.json()["data"][0]["b64_json"])))


def test_an_image_job_without_the_image_a_model_needs_is_one_400_naming_image():
    """No tiny image model needs its image (Qwen-Image-Edit does): the job route's check, on such limits."""
    from layerstream.models.model_rules import ModelRules
    from layerstream.models.output_limits import OutputGeometry
    from layerstream.server.limits import ModelLimits, check_image_presence

    rules = ModelRules(
        model="qwen-image-edit", pipeline_class="QwenImageEditPipeline", kind="image",
        geometry=OutputGeometry(size_multiple=16, frame_multiple=None, max_side_pixels=None, max_frames=None),
        image_input="required", default_width=None, default_height=None, default_num_frames=None,
        default_num_inference_steps=4, default_guidance_scale=None, fps=16, takes=frozenset({"negative_prompt"}),
    )  # fmt: skip
    limits = ModelLimits(rules=rules, max_frames=1, max_side_pixels=1024, max_latent_positions=None, max_work=10**8)
    with pytest.raises(ApiError) as raised:
        check_image_presence(limits, has_image=False, endpoint="POST /v1/images/jobs", field="image", how="image (a file)")
    assert (raised.value.status, raised.value.param) == (400, "image")
    assert raised.value.message == "qwen-image-edit generates from an input image: image is required; send it as image (a file)"


def test_an_image_that_is_not_an_image_is_one_415_naming_it(edit_server):
    with edit_server.client() as http:
        files = {"image": ("notes.txt", b"plain text, not an image", "text/plain")}
        assert_one_error_naming(http.post(IMAGE_JOBS, data=EDIT_FIELDS, files=files), 415, "image", "not a PNG, JPEG or WebP file")


@pytest.mark.parametrize(
    "files, status, field, words",
    [
        ([("image", ("a.png", EDIT_IMAGE, "image/png")), ("image", ("b.png", EDIT_IMAGE, "image/png"))], 422, "image", "takes one input image"),
        ([("image[]", ("a.png", EDIT_IMAGE, "image/png")), ("image[]", ("b.png", EDIT_IMAGE, "image/png"))], 422, "image", "takes one input image"),
        ([("image", ("a.png", EDIT_IMAGE, "image/png")), ("mask", ("m.png", EDIT_IMAGE, "image/png"))], 422, "mask", "not supported"),
        ([("image", ("a.png", EDIT_IMAGE, "image/png")), ("prompt_file", ("p.txt", b"fox", "text/plain"))], 422, "prompt_file", "file part"),
    ],
    ids=["two-images", "two-in-a-list", "mask", "another-file"],
)
def test_more_files_than_one_image_are_one_422_naming_the_part(edit_server, files, status, field, words):
    with edit_server.client() as http:
        assert_one_error_naming(http.post(IMAGE_JOBS, data=EDIT_FIELDS, files=files), status, field, words)


def test_an_image_on_an_image_model_that_takes_none_is_one_400_naming_it(shared_server):
    server = shared_server("tiny-flux")
    with server.client() as http:
        jobs_before = http.get(IMAGE_JOBS, params={"limit": 100}).json()["data"]
        response = http.post(IMAGE_JOBS, data=EDIT_FIELDS, files={"image": ("cat.png", EDIT_IMAGE, "image/png")})
        assert_one_error_naming(response, 400, "image", "takes no input image")
        assert http.get(IMAGE_JOBS, params={"limit": 100}).json()["data"] == jobs_before  # nothing stored
