"""A load generator that speaks vllm-omni's request shapes, against `layerstream serve`.

    python benchmarks/vllm_omni_load.py --url http://127.0.0.1:8000 --requests 8 --concurrency 2

Each request is one of the shapes vllm-omni's clients send, taken in turn: for a video model, its job API as
JSON, as a multipart form (its curl examples), as a url-encoded form (its serving benchmark's aiohttp form),
each polled until it ends and its MP4 downloaded, and ``POST /v1/videos/sync`` (the MP4 in the answer); for an
image model, ``POST /v1/images/generations`` as its OpenAI-style client sends it. A request succeeds when its
output arrives (an MP4 or PNG); the report counts requests per shape, failures by reason, and the seconds they
took. Exits 1 if any request failed. `run_load` takes any httpx-style client, so a test drives it in process.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

VIDEO_SHAPES = ("videos-json", "videos-multipart", "videos-urlencoded", "videos-sync")
IMAGE_SHAPES = ("images-json",)


@dataclass
class LoadReport:
    model: str
    num_requests: int
    num_failed: int
    shapes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def video_body(seed: int, *, size: str, frames: int, steps: int) -> dict[str, Any]:
    """vllm-omni's Wan 2.2 text-to-video fields, at a size the served model takes (a form sends them as text)."""
    width, height = (int(side) for side in size.split("x"))
    return {
        "prompt": "a red fox running through the snow", "negative_prompt": "blurry, low quality", "width": width,
        "height": height, "num_frames": frames, "fps": 16, "num_inference_steps": steps, "guidance_scale": 4.0,
        "seed": seed,
    }  # fmt: skip


def _ended_job(client: Any, job_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := client.get(f"/v1/videos/{job_id}").json())["status"] not in ("completed", "failed"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
        time.sleep(0.05)
    return job


def send(client: Any, shape: str, seed: int, *, size: str, frames: int, steps: int, timeout: float) -> None:
    """One request of `shape`; raises (with the reason) unless its output arrived."""
    body = video_body(seed, size=size, frames=frames, steps=steps)
    form = {name: str(value) for name, value in body.items()}
    if shape == "images-json":
        answer = client.post("/v1/images/generations", json={"prompt": body["prompt"], "size": size, "seed": seed, "num_inference_steps": steps})
        answer.raise_for_status()
        png = base64.b64decode(answer.json()["data"][0]["b64_json"])
        assert png[:4] == b"\x89PNG", "not a PNG"
        return
    if shape == "videos-sync":
        answer = client.post("/v1/videos/sync", files={name: (None, value) for name, value in form.items()})
        answer.raise_for_status()
        assert answer.headers["content-type"] == "video/mp4" and answer.content[4:8] == b"ftyp", "not an MP4"
        return
    if shape == "videos-json":
        made = client.post("/v1/videos", json=body)
    elif shape == "videos-multipart":
        made = client.post("/v1/videos", files={name: (None, value) for name, value in form.items()})
    else:  # videos-urlencoded
        made = client.post("/v1/videos", data=form)
    made.raise_for_status()
    job = _ended_job(client, made.json()["id"], timeout)
    if job["status"] != "completed":
        raise RuntimeError(f"job failed: {job.get('error')}")
    content = client.get(f"/v1/videos/{job['id']}/content")
    content.raise_for_status()
    assert content.content[4:8] == b"ftyp", "not an MP4"


def run_load(
    client: Any, *, num_requests: int, concurrency: int, size: str = "32x32", frames: int = 5, steps: int = 2,
    timeout: float = 300.0, send_one: Callable[..., None] = send,
) -> LoadReport:
    """`num_requests` requests over the shapes the served model takes (from `/health`), `concurrency` at a time."""
    health = client.get("/health").json()
    shapes = VIDEO_SHAPES if health["kind"] == "video" else IMAGE_SHAPES
    report = LoadReport(model=health["model"], num_requests=num_requests, num_failed=0)
    failures: Counter[str] = Counter()
    started = time.perf_counter()

    def one(index: int) -> None:
        shape = shapes[index % len(shapes)]
        try:
            send_one(client, shape, index, size=size, frames=frames, steps=steps, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - counted by reason: the report is the point
            failures[f"{shape}: {type(e).__name__}: {str(e)[:120]}"] += 1

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(num_requests)))
    report.seconds = time.perf_counter() - started
    report.shapes = dict(Counter(shapes[i % len(shapes)] for i in range(num_requests)))
    report.failures = dict(failures)
    report.num_failed = sum(failures.values())
    return report


def main(argv: list[str] | None = None) -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--size", default="32x32", help="WIDTHxHEIGHT the served model takes")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    args = parser.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        report = run_load(client, num_requests=args.requests, concurrency=args.concurrency, size=args.size,
                          frames=args.frames, steps=args.steps, timeout=args.timeout)  # fmt: skip
    print(json.dumps(asdict(report), indent=2))
    return 1 if report.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
