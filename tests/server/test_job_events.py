"""The event stream of a job on `layerstream serve tiny-flux`: steps in order, previews that decode and
change nothing, and a client that leaves without stopping the job."""

from __future__ import annotations

import base64
import io

import torch
from PIL import Image

from jobs_harness import IMAGE_JOBS, png_pixels, read_events, wait_for_job

BODY = {"prompt": "a red fox", "size": "48x32", "seed": 9, "num_inference_steps": 4}
LEAVING_STEPS = 50
"""The job a client leaves: its steps after the first outlast the hang-up many times over."""


def test_events_arrive_in_order_and_previews_decode_and_change_nothing(shared_server):
    server = shared_server("tiny-flux")
    with server.client() as http:
        plain = http.post(IMAGE_JOBS, json=BODY).json()
        previewed = http.post(IMAGE_JOBS, json={**BODY, "preview": True}).json()
        assert previewed["object"] == "image" and previewed["status"] in ("queued", "in_progress")
        with http.stream("GET", f"{IMAGE_JOBS}/{previewed['id']}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = read_events(response)
        names = [name for name, _ in events]
        assert names[0] == "status" and names[-1] == "status" and events[-1][1]["status"] == "completed"
        statuses = [data["status"] for name, data in events if name == "status"]
        assert statuses[-2:] == ["in_progress", "completed"] and len(set(statuses)) == len(statuses)
        steps = [data["step"] for name, data in events if name == "progress"]
        assert steps[:4] == [1, 2, 3, 4] and all(data["total"] == 4 for name, data in events if name == "progress")
        percents = [data["progress"] for name, data in events if name == "progress"]
        assert percents == sorted(percents) and percents[-1] < 100
        previews = [data for name, data in events if name == "preview"]
        assert [p["step"] for p in previews] == [1, 2, 3, 4]
        for preview in previews:
            header, _, payload = preview["image"].partition(",")
            assert header == "data:image/png;base64"
            image = Image.open(io.BytesIO(base64.b64decode(payload)))
            assert image.size == (48 // 8, 32 // 8)  # a pixel per latent position (the VAE's 8x)
        wait_for_job(http, IMAGE_JOBS, plain["id"])
        with_previews = png_pixels(http.get(f"{IMAGE_JOBS}/{previewed['id']}/content").content)
        without = png_pixels(http.get(f"{IMAGE_JOBS}/{plain['id']}/content").content)
        assert torch.equal(with_previews, without) and tuple(without.shape) == (32, 48, 3)


def test_a_client_that_leaves_does_not_stop_the_job(shared_server):
    server = shared_server("tiny-flux")
    with server.client() as http:
        job = http.post(IMAGE_JOBS, json={**BODY, "num_inference_steps": LEAVING_STEPS}).json()
        with http.stream("GET", f"{IMAGE_JOBS}/{job['id']}/events") as response:
            lines = response.iter_lines()
            assert next(lines) == "event: status"
            # hang up once the job has taken its first step: it is running when its client leaves
            assert "event: progress" in lines
        done = wait_for_job(http, IMAGE_JOBS, job["id"])
        assert done["status"] == "completed" and done["layerstream"]["step"] == LEAVING_STEPS
        # a finished job's stream is its final status, then the end
        with http.stream("GET", f"{IMAGE_JOBS}/{job['id']}/events") as response:
            assert [(n, d["status"]) for n, d in read_events(response)] == [("status", "completed")]
        assert http.get(f"{IMAGE_JOBS}/image_missing/events").status_code == 404
