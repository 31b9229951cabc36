"""`layerstream serve tiny-wan`: MP4 videos, the frame rule, and the image endpoint refused."""

from __future__ import annotations

import base64

import imageio.v3 as iio
import pytest

from serve_contract import HEALTH_KEYS, RESPONSE_KEYS, VIDEO_DATA_KEYS
from serve_harness import IMAGES, VIDEOS

CONFIG = '{"mode": "layer", "components": ["dit", "text_encoder"]}'


@pytest.fixture(scope="module")
def client(server_factory):
    server = server_factory("tiny-wan", "--diffusion-offload-config", CONFIG, "--max-frames", "13", "--max-queue", "4")
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
