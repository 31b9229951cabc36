"""/metrics through prometheus_client: well-formed, named as Prometheus advises, one registry per app, job
states, and each job's own share of a batch call's time."""

from __future__ import annotations

import time
from types import SimpleNamespace

import prometheus_client
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import layerstream.server.in_process as runner_module
from layerstream.server.app import create_app
from layerstream.server.metrics import JOB_STATES, JobOutcome, QueueState, ServerMetrics
from layerstream.server.schemas import ImageGenerationRequest
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from test_service import StandInOmni

OFFLOAD = SimpleNamespace(
    bytes_transferred=10, num_transfers=2, num_sync_loads=0, stall_seconds=0.25, device_bytes=5, host_bytes=7,
    pinned_host_bytes=7, slot_bytes=4, max_materialized_blocks=2, disk_bytes_read=9, disk_stall_seconds=0.125,
    host_pool_bytes=3, disk_staging_bytes=6,
)  # fmt: skip
QUEUE = QueueState(depth=1, max_waiting=4, running=True, num_submitted=3, num_started=2)


def families(text: str) -> dict[str, prometheus_client.Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


def render(metrics: ServerMetrics) -> str:
    return metrics.render(queue=QUEUE, offload=OFFLOAD, labels={"model": "m", "kind": "image", "device": "cpu"})


@pytest.fixture
def app_client():
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0))
    with TestClient(create_app(service), base_url="http://127.0.0.1") as client:
        yield client


def test_the_served_text_is_well_formed_and_named_as_prometheus_advises(app_client):
    body = {"prompt": "fox", "size": "16x16", "num_inference_steps": 1}
    assert app_client.post("/v1/images/generations", json=body).status_code == 200
    assert app_client.get("/v1/images/outputs/img_gone.png").status_code == 404
    assert app_client.get("/no/such/path").status_code == 404
    response = app_client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    served = families(response.text)  # the library's own parser reads it
    assert served and all(name.startswith("layerstream_") for name in served)
    for name, family in served.items():
        assert family.documentation, name
        if "bytes" in name or "seconds" in name:
            assert name.endswith(("_bytes", "_seconds")), f"{name}: the unit goes last"
    # route templates label the requests, never the paths clients sent
    text = response.text
    assert sample(text, "layerstream_requests_total", endpoint="/v1/images/outputs/{name}", status="404") == 1
    assert sample(text, "layerstream_requests_total", endpoint="other", status="404") == 1
    assert sample(text, "layerstream_requests_total", endpoint="/v1/images/generations", status="200") == 1
    assert "img_gone" not in text and "/no/such/path" not in text


def test_the_recorded_and_the_offload_figures_are_served_under_one_name_each():
    metrics = ServerMetrics()
    metrics.observe_job(queue_seconds=0.5, seconds=1.5, num_outputs=2, outcome=JobOutcome.OK)
    metrics.observe_request_bytes(123)
    text = render(metrics)
    assert sample(text, "layerstream_streamed_bytes_total") == 10
    assert sample(text, "layerstream_disk_read_bytes_total") == 9
    assert sample(text, "layerstream_job_duration_seconds_sum") == 1.5
    assert sample(text, "layerstream_request_streamed_bytes_sum") == 123
    served = families(text)
    for old in ("layerstream_bytes_streamed", "layerstream_disk_bytes_read", "layerstream_request_bytes_streamed",
                "layerstream_generation_duration_seconds"):  # the names of before prometheus_client
        assert old not in served


def test_each_app_has_a_registry_of_its_own():
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_request("/health", 200, 0.01)
    assert sample(render(first), "layerstream_requests_total", endpoint="/health") == 1
    assert "layerstream_requests_total{" not in render(second)
    assert not any(m.name.startswith("layerstream_") for m in prometheus_client.REGISTRY.collect())  # not global


def test_job_states_move_between_series():
    metrics = ServerMetrics()
    assert [sample(render(metrics), "layerstream_jobs", status=s) for s in JOB_STATES] == [0, 0, 0, 0]
    metrics.record_job_state("video_a", "queued")
    metrics.record_job_state("video_b", "queued")
    metrics.record_job_state("video_a", "in_progress")
    metrics.record_job_state("video_a", "completed")
    assert [sample(render(metrics), "layerstream_jobs", status=s) for s in JOB_STATES] == [1, 0, 1, 0]
    metrics.forget_job("video_a")
    metrics.forget_job("video_unknown")  # nothing to forget: no change
    metrics.record_job_state("video_b", "failed")
    assert [sample(render(metrics), "layerstream_jobs", status=s) for s in JOB_STATES] == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="status = 'done': expected one of queued, in_progress"):
        metrics.record_job_state("video_b", "done")


class FakeClock:
    """The in-process runner's `time`, whose perf_counter moves only when a pipeline call is made."""

    def __init__(self, seconds_per_call: float):
        self.now = 0.0
        self.seconds_per_call = seconds_per_call
        self.monotonic = time.monotonic

    def perf_counter(self) -> float:
        return self.now

    def call(self, index: int) -> None:
        self.now += self.seconds_per_call


def _start_service(monkeypatch, clock: FakeClock, **settings) -> GenerationService:
    monkeypatch.setattr(runner_module, "time", clock)
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0, **settings))
    service.omni.on_call = clock.call
    service.start()
    return service


def _submit(service: GenerationService, n: int):
    request = ImageGenerationRequest(prompt="fox", size="16x16", num_inference_steps=1, seed=1, n=n)
    return service.submit(service.prepare(request))


def test_a_batched_request_records_its_own_share_of_the_call(monkeypatch):
    clock = FakeClock(seconds_per_call=61.0)
    service = _start_service(monkeypatch, clock, max_batch_size=3, batch_wait_ms=5000)
    try:
        jobs = [_submit(service, n) for n in (2, 1, 1)]
        for job in jobs:
            job.future.result(10)
    finally:
        assert service.stop()
    assert service.omni.batches and len(service.omni.batches) == 1  # one call of 61 s for the three
    text = service.render_metrics()
    assert sample(text, "layerstream_job_duration_seconds_count") == 3
    assert sample(text, "layerstream_job_duration_seconds_sum") == 61.0  # 30.5 + 15.25 + 15.25, not 3 x 61
    assert sample(text, "layerstream_job_duration_seconds_bucket", le="30.0") == 2  # the two of one output
    assert sample(text, "layerstream_queue_wait_seconds_count") == 3


def test_a_request_run_alone_records_its_whole_time(monkeypatch):
    clock = FakeClock(seconds_per_call=5.0)
    service = _start_service(monkeypatch, clock)
    try:
        _submit(service, 2).future.result(10)  # two outputs, one call each
    finally:
        assert service.stop()
    text = service.render_metrics()
    assert sample(text, "layerstream_job_duration_seconds_sum") == 10.0
    assert sample(text, "layerstream_generations_total", outcome="ok") == 2
