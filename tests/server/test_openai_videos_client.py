"""OpenAI's official client against `layerstream serve tiny-wan`: the videos job API as its users call it.

``--link-gbps 0.01`` makes each denoising step take a few hundredths of a second (the simulated link), so a
long job (60 steps and more) is reliably still running when the test cancels it, and the short ones (2 steps)
the other tests wait for are quick.
"""

from __future__ import annotations

import openai
import pytest
import torch

from jobs_harness import VIDEOS, mp4_frames, openai_client, wait_for_job
from serve_harness import wait_until

FAST = {"num_inference_steps": 2, "seed": 5}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client marks videos so


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("tiny-wan", "--link-gbps", "0.01", "--max-frames", "33")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_create_retrieve_download_with_the_official_client(client):
    video = client.videos.create(prompt="a red fox", size="48x32", seconds="1", extra_body=FAST)
    assert video.object == "video" and video.id.startswith("video_") and video.status in ("queued", "in_progress")
    assert (video.size, video.seconds, video.model, video.prompt) == ("48x32", "1", "tiny-wan", "a red fox")
    settings = video.layerstream["settings"]
    # 1 s at Wan's 16 fps on its frame rule (num_frames - 1 a multiple of 4): 17 frames
    assert (settings["num_frames"], settings["fps"], settings["seed"], settings["num_inference_steps"]) == (17, 16, 5, 2)
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at >= done.created_at
    content = client.videos.download_content(video.id)
    assert content.content[4:8] == b"ftyp"
    assert tuple(mp4_frames(content.content).shape) == (17, 32, 48, 3)
    assert done.layerstream["step"] == 2 and done.layerstream["streamed_bytes"] > 0


def test_create_and_poll_works_unmodified(client):
    video = client.videos.create_and_poll(prompt="a cat", size="32x32", extra_body={**FAST, "num_frames": 5}, poll_interval_ms=50)
    assert video.status == "completed" and video.seconds == "0.3125"  # 5 frames at 16 fps


def test_list_pages_newest_first_and_delete_makes_it_404(client):
    made = [client.videos.create_and_poll(prompt=f"fox {i}", size="32x32", extra_body={**FAST, "num_frames": 1}, poll_interval_ms=50) for i in range(3)]
    newest_first = [v.id for v in reversed(made)]
    page = client.videos.list(limit=2)
    assert [v.id for v in page.data] == newest_first[:2] and page.has_more
    following = client.videos.list(limit=2, after=page.data[-1].id)
    assert following.data[0].id == newest_first[2]
    oldest = client.videos.list(limit=1, order="asc")
    assert oldest.data[0].created_at <= made[0].created_at

    deleted = client.videos.delete(made[0].id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made[0].id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(made[0].id)
    assert made[0].id not in [v.id for v in client.videos.list(limit=100).data]


def test_cancel_a_running_job_and_the_next_runs_bit_identical_to_a_fresh_one(server, client):
    running = client.videos.create(prompt="a slow fox", size="32x32", extra_body={"num_inference_steps": 200, "num_frames": 1})
    queued = client.videos.create(prompt="the next fox", size="32x32", extra_body={**FAST, "num_frames": 5, "seed": 11})
    with server.client() as http:
        wait_until(lambda: http.get(f"{VIDEOS}/{running.id}").json()["layerstream"]["step"] >= 1, what="the long job to step")
        assert http.get(f"{VIDEOS}/{queued.id}").json()["layerstream"]["queue_position"] == 1
        client.videos.delete(running.id)
        after_cancel = wait_for_job(http, VIDEOS, queued.id)
    assert after_cancel["status"] == "completed", after_cancel
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(running.id)
    fresh = client.videos.create_and_poll(prompt="the next fox", size="32x32", extra_body={**FAST, "num_frames": 5, "seed": 11}, poll_interval_ms=50)
    first = mp4_frames(client.videos.download_content(queued.id).content)
    again = mp4_frames(client.videos.download_content(fresh.id).content)
    assert torch.equal(first, again)


def test_a_queued_job_deleted_never_runs(server, client):
    running = client.videos.create(prompt="slow", size="32x32", extra_body={"num_inference_steps": 60, "num_frames": 1})
    queued = client.videos.create(prompt="never", size="32x32", extra_body={**FAST, "num_frames": 1})
    assert client.videos.delete(queued.id).deleted
    with server.client() as http:
        assert wait_for_job(http, VIDEOS, running.id)["status"] == "completed"
        assert http.get(f"{VIDEOS}/{queued.id}").status_code == 404
    assert "job " + queued.id + " queued" in server.log() and queued.id + " completed" not in server.log()


def test_json_bodies_and_clear_errors(server):
    with server.client() as http:
        made = http.post(VIDEOS, json={"prompt": "fox", "size": "32x32", "seconds": 0.5, **FAST})
        assert made.status_code == 200 and made.json()["layerstream"]["settings"]["num_frames"] == 9
        for body, param, status in [
            ({"prompt": "fox", "seconds": "four"}, "seconds", 422),
            ({"prompt": "fox", "seconds": "1", "num_frames": 5}, "seconds", 422),
            ({"prompt": "fox", "seconds": 8}, "seconds", 400),  # 129 frames, over --max-frames 33
            ({"prompt": "fox", "model": "sora-2"}, "model", 400),
            ({"prompt": "fox", "num_frames": 6}, "num_frames", 400),
            ({"prompt": "fox", "fps": 0}, "fps", 422),  # a frame rate of its own is taken (vllm-omni's field)
        ]:
            answer = http.post(VIDEOS, json=body)
            assert answer.status_code == status, (body, answer.text)
            assert answer.json()["error"]["param"] == param, answer.text
        job_id = made.json()["id"]
        wait_for_job(http, VIDEOS, job_id)
        for query, param in [("limit=0", "limit"), ("order=up", "order"), ("after=video_none", "after")]:
            assert http.get(f"{VIDEOS}?{query}").json()["error"]["param"] == param
        health = http.get("/health").json()
        assert (health["jobs_path"], health["fps"], health["default_num_frames"], health["takes_image"]) == ("/v1/videos", 16, 9, False)
        assert (health["default_size"], health["default_steps"]) == ("64x64", 4)
