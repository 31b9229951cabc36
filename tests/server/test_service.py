"""`GenerationService` on a stand-in `Omni`: outputs released one at a time, stops between steps."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

from layerstream.config.offload_config import parse_offload_config
from layerstream.models.hub import ModelSource
from layerstream.models.model_rules import read_model_rules
from layerstream.omni import GenerationResult, RunStats
from layerstream.server.metrics import JobOutcome
from layerstream.server.schemas import ImageGenerationRequest
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from layerstream.server.stopping import GenerationStopped, StopReason
from serve_harness import decode_png

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


class QwenImagePipeline:  # a family's name: the extra_params it declares
    def __call__(self, prompt, height=None, width=None, num_inference_steps=2, max_sequence_length=512):  # what limits read
        raise AssertionError("the stand-in Omni never calls its pipeline")


class StandInOmni:
    """Just enough of `Omni` for the service: makes blank images and records what is still alive."""

    model, kind, device, dtype = "stand-in", "image", "cpu", None
    source = ModelSource("stand-in", Path("stand-in"), "folder")
    config = parse_offload_config({"mode": "layer", "components": ["dit"]})

    def __init__(self) -> None:
        self.pipeline = QwenImagePipeline()
        self.rules = read_model_rules(self.pipeline, self.model)
        self.outputs: list[weakref.ref] = []
        self.alive_at_start: list[int] = []
        self.on_call = None  # called with the call's index, before its steps
        self.batches: list[list[tuple[str, int]]] = []  # (prompt, seed) of each output of each batch call

    def stats(self):
        return None

    def component_dtypes(self):
        return {"transformer": "float32"}

    def run(self, request, *, on_step, on_latents=None):
        height, width, num_inference_steps = request.height, request.width, request.num_inference_steps
        gc.collect()
        self.alive_at_start.append(sum(ref() is not None for ref in self.outputs))
        if self.on_call is not None:
            self.on_call(len(self.alive_at_start) - 1)
        for step in range(num_inference_steps):
            on_step(step + 1, num_inference_steps, 0.0)
        raw = np.full((1, height, width, 3), 0.5, dtype=np.float32)
        frames = (raw * 255).astype(np.uint8)
        self.outputs += [weakref.ref(raw), weakref.ref(frames)]
        stats = RunStats(seconds=0.0, step_seconds=[0.0] * num_inference_steps, bytes_transferred=0, num_transfers=0,
                         num_sync_loads=0, stall_seconds=0.0, device_bytes=0, host_bytes=0)  # fmt: skip
        return GenerationResult(kind="image", frames=frames, stats=stats, raw=raw)

    def run_batch(self, requests, *, on_step):
        height, width, num_inference_steps = requests[0].height, requests[0].width, requests[0].num_inference_steps
        prompts = [r.prompt for r in requests for _ in r.seeds]
        seeds = [seed for r in requests for seed in r.seeds]
        self.batches.append(list(zip(prompts, seeds)))
        if self.on_call is not None:
            self.on_call(len(self.batches) - 1)
        for step in range(num_inference_steps):
            on_step(step + 1, num_inference_steps, 0.0)
        stats = RunStats(seconds=0.0, step_seconds=[0.0] * num_inference_steps, bytes_transferred=len(prompts) * 100,
                         num_transfers=0, num_sync_loads=0, stall_seconds=0.0, device_bytes=0, host_bytes=0)  # fmt: skip
        results = []
        for seed in seeds:  # each output's pixels carry its seed, to tell whose output went where
            raw = np.full((1, height, width, 3), seed / 255, dtype=np.float32)
            frames = (raw * 255).round().astype(np.uint8)
            results.append(GenerationResult(kind="image", frames=frames, stats=stats, raw=raw))
        return results


@pytest.fixture
def service():
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0))
    service.start()
    yield service
    assert service.stop()


def _run(service: GenerationService, **fields):
    params = service.prepare(ImageGenerationRequest(prompt="fox", size="16x16", num_inference_steps=2, **fields))
    return service.submit(params).future.result(10)


def test_each_output_is_encoded_and_released_before_the_next_one_starts(service):
    output = _run(service, n=3, seed=1)
    assert len(output.files) == 3 and output.usage.seeds == [1, 2, 3] and output.usage.width == 16
    # no earlier output's float or uint8 frames are alive while the next is generated
    assert service.omni.alive_at_start == [0, 0, 0]


def test_a_stop_requested_between_steps_ends_the_job_and_the_next_one_runs(service):
    def stop_during_second_output(index: int) -> None:
        if index == 1:
            service.queue.stop_running(StopReason.TIMEOUT)

    service.omni.on_call = stop_during_second_output
    with pytest.raises(GenerationStopped, match=r"after step 1 of 2 \(output 2 of 3\)") as info:
        _run(service, n=3)
    assert info.value.reason is StopReason.TIMEOUT
    assert len(service.omni.alive_at_start) == 2  # the third output never started
    service.omni.on_call = None
    assert len(_run(service).files) == 1
    text = service.render_metrics()
    assert f'layerstream_generations_total{{outcome="{JobOutcome.STOPPED}"}} 3.0' in text
    assert 'layerstream_generations_total{outcome="ok"} 1.0' in text


@pytest.fixture
def batching_service():
    settings = ServeSettings(port=0, shutdown_timeout=0, max_batch_size=3, batch_wait_ms=5000)
    service = GenerationService(StandInOmni(), settings)
    service.start()
    yield service
    assert service.stop()


def _submit(service: GenerationService, prompt: str, seed: int, **fields):
    request = ImageGenerationRequest(prompt=prompt, size="16x16", num_inference_steps=2, seed=seed, **fields)
    return service.submit(service.prepare(request))


def test_a_batch_answers_each_request_with_its_own_outputs(batching_service):
    jobs = [_submit(batching_service, prompt, seed, n=n) for prompt, seed, n in [("fox", 10, 2), ("cat", 20, 1), ("owl", 30, 1)]]
    outputs = [job.future.result(10) for job in jobs]
    assert batching_service.omni.batches == [[("fox", 10), ("fox", 11), ("cat", 20), ("owl", 30)]]
    assert [o.usage.seeds for o in outputs] == [[10, 11], [20], [30]]
    assert [o.usage.batch_size for o in outputs] == [3, 3, 3]
    assert [o.usage.bytes_streamed for o in outputs] == [200, 100, 100]  # the call's 400 bytes, shared by outputs
    pixels = [[decode_png(f)[0, 0, 0] for f in o.files] for o in outputs]
    assert pixels == [[10, 11], [20], [30]]
    text = batching_service.render_metrics()
    assert "layerstream_batch_size_count 1.0" in text and "layerstream_batch_size_sum 3.0" in text


def test_only_requests_with_equal_extra_params_share_a_batch(batching_service):
    extra = {"extra_params": {"max_sequence_length": 8}}
    given = [("fox", {}), ("cat", extra), ("owl", {}), ("ant", extra), ("bee", {}), ("yak", extra)]
    jobs = [_submit(batching_service, prompt, seed, **fields) for seed, (prompt, fields) in enumerate(given)]
    assert all(len(job.future.result(10).files) == 1 for job in jobs)
    assert [[prompt for prompt, _ in batch] for batch in batching_service.omni.batches] == [["fox", "owl", "bee"], ["cat", "ant", "yak"]]


def test_a_request_stopped_in_a_batch_drops_its_outputs_and_the_others_run_on(batching_service):
    def stop_the_second(index: int) -> None:
        jobs[1].stop_signal.request(StopReason.CLIENT_GONE)

    batching_service.omni.on_call = stop_the_second
    jobs = [_submit(batching_service, name, seed) for name, seed in [("fox", 1), ("cat", 2), ("owl", 3)]]
    assert len(jobs[0].future.result(10).files) == 1 and len(jobs[2].future.result(10).files) == 1
    with pytest.raises(GenerationStopped, match="during its batch") as info:
        jobs[1].future.result(10)
    assert info.value.reason is StopReason.CLIENT_GONE
    assert f'layerstream_generations_total{{outcome="{JobOutcome.STOPPED}"}} 1.0' in batching_service.render_metrics()


def test_a_batch_stops_between_steps_once_every_request_asked(batching_service):
    def stop_all(index: int) -> None:
        for job in jobs:
            job.stop_signal.request(StopReason.TIMEOUT)

    batching_service.omni.on_call = stop_all
    jobs = [_submit(batching_service, name, seed) for name, seed in [("fox", 1), ("cat", 2), ("owl", 3)]]
    for job in jobs:
        with pytest.raises(GenerationStopped, match=r"after step 1 of 2 \(a batch of 3 request"):
            job.future.result(10)


def test_prepare_carries_the_body_as_one_generation_request_with_the_model_shape_filled_in(service):
    from dataclasses import replace

    body = ImageGenerationRequest(prompt="fox", size="16x16", seed=5, n=2, timeout=30.0)
    served = service.prepare(body)
    # the body's request, with the steps the checks priced (the model's default) and no field spelled again
    assert served.request == replace(body.generation_request(seed=5), num_inference_steps=served.request.num_inference_steps)
    assert served.request.seeds == (5, 6) and served.request.timeout == 30.0 and served.request.num_inference_steps >= 1
    assert served.batch_key() == served.request.batch_shape()
    job = service.submit(served)
    assert job.timeout == 30.0  # the queue's deadline is the request's own
    assert job.future.result(10).usage.seeds == [5, 6]
