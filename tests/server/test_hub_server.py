"""`serve <hub id> --omni`, as vllm-omni's guide writes it, against the stand-in Hub: the model is downloaded,
served, and a job runs to the end with the revision in /health and in the job's record."""

from __future__ import annotations

import pytest

from hub_standin import serving_standin_hub
from jobs_harness import VIDEOS, mp4_frames, wait_for_job

from layerstream.models import ensure_tiny_model

REPO = "test-org/tiny-wan"


@pytest.fixture(scope="module")
def standin():
    with serving_standin_hub() as hub:
        hub.add_repo(REPO, ensure_tiny_model("tiny-wan"))
        yield hub


def test_serve_a_hub_id_with_vllm_omnis_flag_through_a_job(standin, server_factory, tmp_path):
    env = {"HF_ENDPOINT": standin.url, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0"}
    config = '{"mode":"layer","components":["dit"]}'
    server = server_factory(REPO, "--omni", "--diffusion-offload-config", config, env=env)
    commit = standin.repos[REPO].refs["main"]
    with server.client() as http:
        health = http.get("/health").json()
        assert health["model"] == REPO
        assert (health["model_source"]["origin"], health["model_source"]["revision"], health["model_source"]["commit"]) == (
            "hub", "main", commit,
        )  # fmt: skip
        job = http.post(VIDEOS, json={"prompt": "a fox", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}).json()
        done = wait_for_job(http, VIDEOS, job["id"])
        assert done["status"] == "completed" and done["model"] == REPO
        settings = done["layerstream"]["settings"]
        assert (settings["model_revision"], settings["model_commit"]) == ("main", commit)
        frames = mp4_frames(http.get(f"{VIDEOS}/{job['id']}/content").content)
        assert tuple(frames.shape[:3]) == (5, 32, 32)
    assert "layerstream: downloading test-org/tiny-wan/transformer/diffusion_pytorch_model.safetensors" in server.log()
    assert server.terminate() == 0
