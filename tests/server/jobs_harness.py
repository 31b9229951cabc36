"""Helpers of the job API tests: OpenAI's client on a test server, waiting for jobs, reading their outputs."""

from __future__ import annotations

import io
import json
import time
import warnings

import httpx
import numpy as np
import torch

VIDEOS = "/v1/videos"
IMAGE_JOBS = "/v1/images/jobs"


def openai_client(server):
    """OpenAI's official client pointed at `server` (its videos API is marked deprecated: not our concern)."""
    from openai import OpenAI

    warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def wait_for_job(client: httpx.Client, path: str, job_id: str, statuses=("completed", "failed"), timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"{path}/{job_id}").json()
        if job.get("status") in statuses:
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job.get('status')} after {timeout} s")
        time.sleep(0.05)


def mp4_frames(data: bytes) -> torch.Tensor:
    import imageio.v3 as iio

    return torch.from_numpy(np.ascontiguousarray(iio.imread(data, index=None, extension=".mp4")))


def png_pixels(data: bytes) -> torch.Tensor:
    from PIL import Image

    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())


def read_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a whole text/event-stream response, in order."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events
