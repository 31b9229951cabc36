"""Every output carries the settings that make it again: a job's file and the synchronous endpoint's the same
(the job's id aside), however long the prompts, and read back whole."""

from __future__ import annotations

import json

from jobs_harness import VIDEOS, wait_for_job

from layerstream.outputs import read_output_metadata

FOXES = "\U0001f98a" * 10_000
"""A prompt at the 10,000-character cap: two of them make settings past 128 KiB, the most one command-line
argument may hold on Linux (the MP4's settings once went to ffmpeg as one)."""


def test_a_job_s_settings_past_128_kib_round_trip_and_the_sync_endpoint_writes_the_same(shared_server, tmp_path):
    server = shared_server("tiny-wan")
    body = {"prompt": FOXES, "negative_prompt": FOXES, "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3}
    with server.client() as http:
        offload_config = http.get("/health").json()["offload_config"]
        created = http.post(VIDEOS, json=body)
        assert created.status_code == 200, created.text
        job = wait_for_job(http, VIDEOS, created.json()["id"])
        assert job["status"] == "completed", job["error"]
        (tmp_path / "job.mp4").write_bytes(http.get(f"{VIDEOS}/{job['id']}/content").content)
        sync = http.post("/v1/videos/sync", json=body)
        assert sync.status_code == 200 and sync.headers["content-type"] == "video/mp4", sync.text
        (tmp_path / "sync.mp4").write_bytes(sync.content)
    from_job = read_output_metadata(tmp_path / "job.mp4")
    assert len(json.dumps(from_job)) > 128 * 1024
    shown = {k: v for k, v in job["layerstream"]["settings"].items() if k != "vae_decode"}  # how it decoded: a figure
    assert from_job == {**shown, "model": "tiny-wan", "offload_config": offload_config, "job_id": job["id"]}
    assert read_output_metadata(str(tmp_path / "sync.mp4")) == {k: v for k, v in from_job.items() if k != "job_id"}
