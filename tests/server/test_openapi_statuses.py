"""The OpenAPI document states every status each route answers, checked against the server: each route of an
image model's app (generations, edits, kept outputs, the job API, health, metrics) is made to answer every
status its entry lists, 507 included (a database filled to its page limit, as a full disk fills it), and the
access checks' 403 (a foreign Host; another site's Origin) and 401 (no API key: the app has one), and every
answer the server gives along the way is one its route's entry lists.

The app runs in this process (FastAPI's test client) on a stand-in model that takes an optional image; its
worker is held on a gate where a full queue or a timeout is wanted. The video routes are held to the same
document by tests/server/test_openapi_contract.py (schemathesis, on tiny-wan)."""

from __future__ import annotations

import io
import threading
from unittest import mock

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from starlette.routing import Match

from layerstream.server import bodies
from layerstream.server.connections import BodyPace
from serve_harness import wait_until
from test_image_intake import _EditOmni

pytestmark = pytest.mark.fast

JOBS = "/v1/images/jobs"
GENERATE = {"prompt": "a fox", "size": "16x16", "num_inference_steps": 1}
FORM = {"prompt": "a fox", "size": "16x16", "num_inference_steps": "1"}
KEY = "sk-statuses"


class _GatedOmni(_EditOmni):
    """The stand-in, whose calls wait at a gate while it is closed, and raise for the prompt ``explode``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def run(self, request, *, on_step, on_latents=None):
        assert self.gate.wait(60)
        if request.prompt == "explode":
            raise RuntimeError("the stand-in exploded")
        return super().run(request, on_step=on_step, on_latents=on_latents)


class _Recorder:
    """The app, recording (method, route template, status) of every answer."""

    def __init__(self, app) -> None:
        self.app = app
        self.answered: set[tuple[str, str | None, int]] = set()

    async def __call__(self, scope, receive, send) -> None:
        async def recording(message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", None) or self._route(scope)
                self.answered.add((scope["method"], route, message["status"]))
            await send(message)

        await self.app(scope, receive, recording if scope["type"] == "http" else send)

    def _route(self, scope) -> str | None:
        """The route template of a request the access checks answered before routing (none of a 405's or 404's)."""
        for route in self.app.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route.path
        return None


def _file(file_format: str, side: int = 16) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((side, side, 3), np.uint8)).save(out, format=file_format)
    return out.getvalue()


@pytest.fixture
def served(tmp_path):
    from layerstream.server.access import AccessSettings
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    omni = _GatedOmni()
    settings = ServeSettings(port=0, shutdown_timeout=0, max_queue=1, max_body_bytes=50_000, max_image_pixels=100_000)
    service = GenerationService(omni, settings)
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data")))
    recorder = _Recorder(create_app(service, jobs, ui=False, access=AccessSettings(api_key=KEY)))
    with TestClient(recorder, base_url="http://127.0.0.1", headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http, recorder, omni, jobs
    omni.gate.set()


def _refuse_access(http, document) -> None:
    """Every operation of `document` asked from a foreign Host (403), from another site's page when it changes
    something (403), and without the key (401 where the key is needed)."""
    for path, operations in document["paths"].items():
        if path.startswith("/v1/videos"):
            continue  # no video route on an image model
        url = path.replace("{", "").replace("}", "")  # a value for each path parameter: its name
        for method in operations:
            answer = http.request(method, url, headers={"host": "evil.example"})
            assert (answer.status_code, answer.json()["error"]["code"]) == (403, "host_not_allowed"), (method, path)
            if method != "get":
                answer = http.request(method, url, headers={"origin": "https://evil.example"})
                assert (answer.status_code, answer.json()["error"]["code"]) == (403, "origin_not_allowed"), (method, path)
            if path.startswith("/v1/"):
                answer = http.request(method, url, headers={"authorization": "Bearer sk-wrong"})
                assert (answer.status_code, answer.json()["error"]["code"]) == (401, "invalid_api_key"), (method, path)


def _provoke(http, omni, jobs) -> None:
    """Make every route answer each status its entry lists."""
    big_image = {"image": ("big.png", _file("PNG", 400), "image/png")}  # 160,000 pixels: over the cap
    bmp = {"image": ("in.png", _file("BMP"), "image/png")}
    png = {"image": ("in.png", _file("PNG"), "image/png")}
    # 200s, and the errors a request answers alone
    http.post("/v1/images/generations", json=GENERATE)
    kept = http.post("/v1/images/generations", json={**GENERATE, "response_format": "url"}).json()["data"][0]["url"]
    http.get(kept)
    http.get("/v1/images/outputs/none")
    http.post("/v1/images/generations", content=b"")  # 400: no JSON
    http.post("/v1/images/generations", json={**GENERATE, "prompt": "x" * 60_000})  # 413
    http.post("/v1/images/generations", json={**GENERATE, "colour": "red"})  # 422
    http.post("/v1/images/generations", json={**GENERATE, "prompt": "explode"})  # 500
    http.post("/v1/images/edits", data=FORM, files=png)
    http.post("/v1/images/edits", json=GENERATE)  # 400: not a form
    http.post("/v1/images/edits", data=FORM, files=big_image)  # 413
    http.post("/v1/images/edits", data=FORM, files=bmp)  # 415
    http.post("/v1/images/edits", data={**FORM, "mask": "x"}, files=png)  # 422
    http.post("/v1/images/edits", data={**FORM, "prompt": "explode"}, files=png)  # 500
    job_id = http.post(JOBS, json=GENERATE).json()["id"]
    wait_until(lambda: http.get(f"{JOBS}/{job_id}").json()["status"] == "completed", what="the job")
    http.post(JOBS, content=b"a fox", headers={"content-type": "text/plain"})  # 400
    http.post(JOBS, data=FORM, files=big_image)  # 413
    http.post(JOBS, data=FORM, files=bmp)  # 415
    http.post(JOBS, json={**GENERATE, "colour": "red"})  # 422
    for query in ({}, {"after": "image_none"}, {"limit": "0"}):  # 200, 400, 422
        http.get(JOBS, params=query)
    for route in ("", "/content", "/events"):
        http.get(f"{JOBS}/{job_id}{route}")
        http.get(f"{JOBS}/image_none{route}")
    with mock.patch.object(bodies, "BODY_PACE", BodyPace(timeout_s=0.0)):  # 408: every body comes too slowly
        http.post("/v1/images/generations", json=GENERATE)
        http.post("/v1/images/edits", data=FORM, files=png)
        http.post(JOBS, json=GENERATE)
    http.get("/health")
    http.get("/metrics")
    http.get(f"/v1/models/{http.get('/v1/models').json()['data'][0]['id']}")
    http.get("/v1/models/none")  # 404
    # a held worker: a job not yet completed (409), a full queue (429), a timeout (504)
    omni.gate.clear()
    running = http.post(JOBS, json=GENERATE).json()["id"]
    wait_until(lambda: http.get(f"{JOBS}/{running}").json()["status"] == "in_progress", what="the held job")
    http.get(f"{JOBS}/{running}/content")
    http.post(JOBS, json=GENERATE)  # waits: the queue is full from here
    http.post(JOBS, json=GENERATE)
    http.post("/v1/images/generations", json=GENERATE)
    http.post("/v1/images/edits", data=FORM, files=png)
    omni.gate.set()
    wait_until(lambda: not jobs.service.queue.running and jobs.service.queue.depth == 0, what="the queue to empty")
    omni.gate.clear()
    http.post(JOBS, json=GENERATE)  # held again: the requests below wait behind it, past their timeout
    http.post("/v1/images/generations", json={**GENERATE, "timeout": 0.001})
    http.post("/v1/images/edits", data={**FORM, "timeout": "0.001"}, files=png)
    omni.gate.set()
    http.delete(f"{JOBS}/{job_id}")
    http.delete(f"{JOBS}/{job_id}")  # 404
    # a database full to its page limit: 507; then the server shutting down: 503 everywhere
    connection = jobs.store._db  # the store's own connection: a page limit is per connection
    (pages,) = connection.execute("PRAGMA page_count").fetchone()
    connection.execute(f"PRAGMA max_page_count = {pages}")
    http.post(JOBS, json={**GENERATE, "prompt": "x" * 9_000})
    connection.execute("PRAGMA max_page_count = 1073741823")
    jobs.service.drain()
    http.post(JOBS, json=GENERATE)
    http.post("/v1/images/generations", json=GENERATE)
    http.post("/v1/images/edits", data=FORM, files=png)
    # a database that refuses every read (its connection closed under it): 503 on every job route
    connection.close()
    http.get(JOBS)
    for route in ("", "/content", "/events"):
        http.get(f"{JOBS}/{running}{route}")
    http.delete(f"{JOBS}/{running}")


def test_every_route_answers_exactly_the_statuses_its_entry_lists(served):
    http, recorder, omni, jobs = served
    document = http.get("/openapi.json").json()
    _refuse_access(http, document)
    _provoke(http, omni, jobs)
    answered: dict[str, set[int]] = {}
    for method, route, status in recorder.answered:
        if route is not None and route != "/openapi.json":
            answered.setdefault(f"{method} {route}", set()).add(status)
    documented = {
        f"{method.upper()} {path}": {int(status) for status in operation["responses"]}
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if not path.startswith("/v1/videos")  # no video route on an image model
    }
    assert answered == documented
    assert 507 in documented[f"POST {JOBS}"]
    assert all(403 in statuses for statuses in documented.values())
    assert 401 in documented[f"GET {JOBS}"] and 401 not in documented["GET /health"]
