"""`layerstream serve tiny-wan`: MP4 videos, the frame rule, and the image endpoint refused."""

from __future__ import annotations

import base64

import imageio.v3 as iio
import pytest

from serve_contract import HEALTH_KEYS, RESPONSE_KEYS, VIDEO_DATA_KEYS
from serve_harness import IMAGES, VIDEOS

CONFIG = '{"mode": "layer", "components": ["dit", "text_encoder"]}'
MAX_WORK = 2_500_000  # the default request (64x64 x 9 frames x 4 steps x 2 passes + 2 texts of 512 tokens) is 1,343,488


@pytest.fixture(scope="module")
def client(server_factory):
    server = server_factory(
        "tiny-wan", "--diffusion-offload-config", CONFIG, "--max-frames", "13", "--max-queue", "4",
        "--max-work", str(MAX_WORK),
    )  # fmt: skip
    with server.client() as c:
        yield c


def test_video_generation_returns_an_mp4(client):
    response = client.post(VIDEOS, json={"prompt": "a red fox", "num_frames": 5, "size": "48x32", "num_inference_steps": 1, "seed": 3, "fps": 8})
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body) == RESPONSE_KEYS and [list(item) for item in body["data"]] == [VIDEO_DATA_KEYS]
    assert body["data"][0]["mime_type"] == "video/mp4"
    usage = body["layerstream"]
    assert usage["num_frames"] == 5 and (usage["width"], usage["height"]) == (48, 32) and usage["seeds"] == [3]
    assert usage["bytes_streamed"] > 0
    mp4 = base64.b64decode(body["data"][0]["b64_json"])
    assert mp4[4:8] == b"ftyp"
    frames = iio.imread(mp4, index=None, extension=".mp4")
    assert frames.shape == (5, 32, 48, 3)


def test_health_reports_model_config_and_rules(client):
    health = client.get("/health").json()
    assert list(health) == HEALTH_KEYS
    assert health["model"] == "tiny-wan" and health["kind"] == "video" and health["status"] == "ok"
    assert health["offload_config"]["components"] == ["dit", "text_encoder"]
    assert (health["frame_multiple"], health["max_frames"], health["max_queue"]) == (4, 13, 4)
    # tiny-wan's rotary tables position 64 latent tokens per axis: 64 x 16 px, below --max-size's 2048
    assert (health["max_side_pixels"], health["max_work"]) == (1024, MAX_WORK)


@pytest.mark.parametrize("size", ["2048x2048", "1040x64"])
def test_a_size_the_model_cannot_position_is_400_naming_size(client, size):
    response = client.post(VIDEOS, json={"prompt": "fox", "size": size, "num_frames": 1, "num_inference_steps": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "size" and error["code"] == "invalid_for_model"
    assert "to 1024" in error["details"][0]["allowed"] and "64 latent tokens" in error["details"][0]["allowed"]


def test_a_request_over_the_work_cap_is_400_naming_the_field_that_asks_most(client):
    # the attack from the issue: largest size, frames, steps and n at once (its size is refused first)
    attack = {"prompt": "fox", "size": "2048x2048", "num_frames": 129, "num_inference_steps": 1000, "n": 4}
    assert client.post(VIDEOS, json=attack).status_code == 400
    # every field in range on its own, but together 64x64 x 13 frames x 20 steps x 2 passes + 1,048,576 = 3,178,496
    response = client.post(VIDEOS, json={"prompt": "fox", "num_frames": 13, "num_inference_steps": 20})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "num_inference_steps" and "3,178,496" in error["message"]
    assert "--max-work" in error["details"][0]["allowed"] and "2,500,000" in error["details"][0]["allowed"]


@pytest.mark.parametrize(
    "num_frames, why",
    [(6, "num_frames - 1 a multiple of 4"), (8, "num_frames - 1 a multiple of 4"), (17, "from 1 to 13")],
)
def test_frames_breaking_the_rule_or_the_cap_are_400(client, num_frames, why):
    response = client.post(VIDEOS, json={"prompt": "fox", "num_frames": num_frames})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "num_frames" and why in error["details"][0]["allowed"]


def test_image_endpoint_on_a_video_model_is_400(client):
    response = client.post(IMAGES, json={"prompt": "fox"})
    assert response.status_code == 400
    assert "tiny-wan makes videos" in response.json()["error"]["message"]


def test_an_image_for_a_text_to_video_model_is_400_naming_image(client):
    response = client.post(VIDEOS, json={"prompt": "fox", "num_frames": 1, "image": "aGVsbG8="})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "image" and "takes no input image" in error["message"]
    assert client.get("/health").json()["image_input"] == "none"
