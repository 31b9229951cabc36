"""The event loop never waits on a large decode: while one client's upload is being decoded, another client's job
is created, runs, and its progress events reach it. Shown by the order of events, not by a timing bound: the
base64 decode of the large upload is held until the other job has ended, and every event of that job arrived
while it was held (were the decode on the event loop, nothing could arrive until it let go).

The app runs in this process (FastAPI's test client) on tiny-wan-i2v, whose jobs take an input image.
"""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

JOBS = "/v1/videos"
LARGE = 4_000_000  # characters of base64: the upload whose decode is held


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from layerstream.omni import Omni
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    omni = Omni("tiny-wan-i2v", device="cpu")
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path_factory.mktemp("data"))))
    try:
        with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
            yield client
    finally:
        omni.close()


def _png_base64() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_a_jobs_events_arrive_while_another_upload_is_being_decoded(client, monkeypatch):
    import layerstream.server.jobs.routes as routes

    decoding, released, decoded = threading.Event(), threading.Event(), threading.Event()
    real_decode = routes.decode_base64_image

    def held_decode(text, field="image"):
        if len(text) < LARGE:
            return real_decode(text, field)
        decoding.set()  # the large upload: held until the test lets go (or 30 s, were the event loop held too)
        released.wait(30)
        try:
            return real_decode(text, field)
        finally:
            decoded.set()

    monkeypatch.setattr(routes, "decode_base64_image", held_decode)
    answers: dict[str, object] = {}
    large = {"prompt": "a large upload", "size": "32x32", "input_reference": "A" * LARGE}
    uploader = threading.Thread(target=lambda: answers.update(large=client.post(JOBS, json=large)))
    uploader.start()
    try:
        assert decoding.wait(60)
        body = {"prompt": "a fox", "size": "32x32", "seconds": "1", "num_inference_steps": 3, "input_reference": _png_base64()}
        created = client.post(JOBS, json=body)  # answered while the decode is held
        assert created.status_code == 200, created.text
        events = []
        with client.stream("GET", f"{JOBS}/{created.json()['id']}/events") as stream:
            name = None
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[len("data: "):]), decoded.is_set()))
                    if name == "status" and events[-1][1].get("status") in ("completed", "failed"):
                        break
    finally:
        released.set()
        uploader.join(60)
    assert events[-1][1]["status"] == "completed", events[-1]
    assert [e for e in events if e[0] == "progress"], "no progress event arrived"
    assert not [e for e in events if e[2]], "an event arrived only after the held decode had ended"
    assert answers["large"].status_code == 415  # its bytes were no image: answered once decoded, not before
