"""`GenerationService` on a stand-in `Omni`: outputs released one at a time, stops between steps."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from layerstream.omni import GenerationResult, RunStats
from layerstream.server.metrics import JobOutcome
from layerstream.server.schemas import ImageGenerationRequest
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from layerstream.server.stopping import GenerationStopped, StopReason


class _Pipeline:
    def __call__(self, prompt, height=None, width=None, num_inference_steps=2):  # what limits read
        raise AssertionError("the stand-in Omni never calls its pipeline")


class StandInOmni:
    """Just enough of `Omni` for the service: makes blank images and records what is still alive."""

    model, kind, device, dtype = "stand-in", "image", "cpu", None

    def __init__(self) -> None:
        self.pipeline = _Pipeline()
        self.outputs: list[weakref.ref] = []
        self.alive_at_start: list[int] = []
        self.on_call = None  # called with the call's index, before its steps

    def stats(self):
        return None

    def component_dtypes(self):
        return {"transformer": "float32"}

    def generate(self, prompt, negative_prompt=None, *, height, width, num_inference_steps, on_step, **kwargs):
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


@pytest.fixture
def service():
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0))
    service.start()
    yield service
    assert service.stop()


def _run(service: GenerationService, **fields):
    params = service.prepare(ImageGenerationRequest(prompt="fox", size="16x16", num_inference_steps=2, **fields))
    return service.submit(params, timeout=None).future.result(10)


def test_each_output_is_encoded_and_released_before_the_next_one_starts(service):
    output = _run(service, n=3, seed=1)
    assert len(output.files_b64) == 3 and output.usage.seeds == [1, 2, 3] and output.usage.width == 16
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
    assert len(_run(service).files_b64) == 1
    text = service.render_metrics()
    assert f'layerstream_generations_total{{outcome="{JobOutcome.STOPPED}"}} 3' in text
    assert 'layerstream_generations_total{outcome="ok"} 1' in text
