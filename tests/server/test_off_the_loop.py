"""The event loop never waits on SQLite or on a multipart parse: while a job database read (a job's event stream
opening, its snapshot) or a form's parse is held, the server still answers another request; and no read or
write of the job database runs on a thread with a running event loop, through a whole job's life on the API.

Shown by the order of answers, not by a timing bound: the held call waits on an event the test sets only after
the other request was answered (were the call on the loop, that answer could only come once the hold gave up).
The app runs in this process (FastAPI's test client) on a stand-in model that takes an optional image."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from layerstream.server.jobs.store import JobStore
from test_image_intake import _EditOmni

pytestmark = pytest.mark.fast

JOBS = "/v1/images/jobs"
JOB = {"prompt": "a fox", "size": "16x16", "num_inference_steps": 1}
STORE_CALLS = ("get", "page", "statuses", "delete", "insert", "update", "enforce_retention_", "recover_")


@pytest.fixture
def app(tmp_path):
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    service = GenerationService(_EditOmni(), ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data", max_jobs=100)))
    return create_app(service, jobs, ui=False), jobs


class _Hold:
    """Holds the call it is given until the test releases it (or 20 s pass: then `over` is set without a release,
    as it is when a loop held by the call goes on)."""

    def __init__(self) -> None:
        self.entered, self.released, self.over = threading.Event(), threading.Event(), threading.Event()

    def wait(self) -> None:
        self.entered.set()
        self.released.wait(20)
        self.over.set()


def _answered_while_held(http: TestClient, hold: _Hold, start_held) -> None:
    """Start `start_held()` on a thread; once its held call is entered, another request must be answered
    before the hold is released."""
    answers: dict[str, object] = {}
    held = threading.Thread(target=lambda: answers.update(held=start_held()))
    held.start()
    try:
        assert hold.entered.wait(30), "the held call was never reached"
        health = http.get("/health")
        answered_while_held = not hold.over.is_set()
    finally:
        hold.released.set()
        held.join(60)
    assert health.status_code == 200 and answered_while_held, "the event loop waited on the held call"
    assert getattr(answers["held"], "status_code", None) == 200, answers


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("nth_read", [1, 2], ids=["the-404-check", "the-first-snapshot"])
def test_an_event_stream_reads_the_database_off_the_loop(app, monkeypatch, nth_read):
    application, jobs = app
    with TestClient(application, base_url="http://127.0.0.1") as http:
        job_id = http.post(JOBS, json=JOB).json()["id"]
        hold, real_get, reads = _Hold(), jobs.store.get, []

        def held_get(wanted: str):
            reads.append(wanted)
            if len(reads) == nth_read:
                hold.wait()
            return real_get(wanted)

        monkeypatch.setattr(jobs.store, "get", held_get)

        def open_stream():
            with http.stream("GET", f"{JOBS}/{job_id}/events") as stream:
                stream.read()  # the job completes quickly: the stream ends with its final status
                return stream

        _answered_while_held(http, hold, open_stream)


@pytest.mark.parametrize("path", [JOBS, "/v1/images/edits"])
def test_a_multipart_form_is_parsed_off_the_loop(app, monkeypatch, path):
    from starlette.formparsers import MultiPartParser

    application, _ = app
    hold, real_parse = _Hold(), MultiPartParser.parse

    async def held_parse(self):
        hold.wait()  # blocks whatever loop it runs on
        return await real_parse(self)

    monkeypatch.setattr(MultiPartParser, "parse", held_parse)
    with TestClient(application, base_url="http://127.0.0.1") as http:
        form = {"prompt": "a fox", "size": "16x16", "num_inference_steps": "1"}
        _answered_while_held(http, hold, lambda: http.post(path, data=form, files={"image": ("in.png", _png(), "image/png")}))


def test_no_database_call_runs_on_an_event_loop(app, monkeypatch):
    """A job's whole life on the API (create by JSON and by form, list, get, events, content, delete), a drain
    (on the event loop, as SIGTERM's) that fails a waiting job, and the server's start and stop: every store call
    is made on a thread without a running event loop."""
    application, jobs = app
    on_a_loop: list[str] = []
    for name in STORE_CALLS:
        real = getattr(jobs.store, name)

        def checked(*args, _name=name, _real=real, **kwargs):
            try:
                asyncio.get_running_loop()
                on_a_loop.append(_name)
            except RuntimeError:  # no loop runs on this thread: a worker thread
                pass
            return _real(*args, **kwargs)

        monkeypatch.setattr(jobs.store, name, checked)
    with TestClient(application, base_url="http://127.0.0.1") as http:
        made = [
            http.post(JOBS, json=JOB).json()["id"],
            http.post(JOBS, data={"prompt": "a fox", "size": "16x16"}, files={"image": ("in.png", _png(), "image/png")}).json()["id"],
        ]
        for job_id in made:
            with http.stream("GET", f"{JOBS}/{job_id}/events") as stream:
                stream.read()
            assert http.get(f"{JOBS}/{job_id}").json()["status"] == "completed"
            assert http.get(f"{JOBS}/{job_id}/content").status_code == 200
        assert [job["id"] for job in http.get(JOBS).json()["data"]] == made[::-1]
        assert all(http.delete(f"{JOBS}/{job_id}").status_code == 200 for job_id in made)
        assert http.get(f"{JOBS}/{made[0]}/events").status_code == 404
        gate = threading.Event()
        jobs.service.omni.on_call = lambda index: gate.wait(30)
        running = http.post(JOBS, json=JOB).json()["id"]
        waiting = http.post(JOBS, json=JOB).json()["id"]
        http.portal.call(jobs.service.drain)  # on the event loop: the waiting job fails at once
        with http.stream("GET", f"{JOBS}/{waiting}/events") as stream:
            assert '"status": "failed"' in stream.read().decode()
        gate.set()
        assert http.get(f"{JOBS}/{running}/events").status_code == 200
    assert on_a_loop == []
