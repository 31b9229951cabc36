"""vllm-omni's `/v1/videos` fields on the served tiny Wan 2.2 (both experts): each reaches the pipeline where
it takes it, a field the pipeline cannot take is a 422 naming it, and the job shows what it used; so does
``extra_params`` in every encoding, and one the model cannot take is a 400 naming its key.

The app runs in this process (FastAPI's test client: no socket), so the pipeline's received arguments can be
read: its class's ``__call__`` is wrapped to record them and the settings in force during the call.
"""

from __future__ import annotations

import functools
import json
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from layerstream.omni import Omni
from layerstream.server.app import create_app
from layerstream.server.jobs.manager import JobManager
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import JobStore
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings

VLLM_OMNI_BODY = {
    "prompt": "a red fox in the snow",
    "negative_prompt": "blurry",
    "width": 32,
    "height": 48,
    "num_frames": 5,
    "fps": 8,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    "guidance_scale_2": 2.0,
    "boundary_ratio": 0.5,
    "flow_shift": 5.0,
    "seed": 42,
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tiny-wan streamed, served with the job API in this process; `calls` records each pipeline call."""
    omni = Omni("tiny-wan", device="cpu")
    calls: list[SimpleNamespace] = []
    pipeline_class = type(omni.pipeline)
    original = pipeline_class.__call__

    @functools.wraps(original)
    def record(self, *args, **kwargs):
        scheduler = self.scheduler
        calls.append(SimpleNamespace(
            kwargs=kwargs, ratio=self.config.boundary_ratio, shift=scheduler.config.get("flow_shift"),
            scheduler=type(scheduler).__name__,
        ))  # fmt: skip
        return original(self, *args, **kwargs)

    pipeline_class.__call__ = record
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    data = tmp_path_factory.mktemp("data")
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=data)))
    try:
        with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
            yield SimpleNamespace(client=client, calls=calls, omni=omni, data=data)
    finally:
        pipeline_class.__call__ = original
        omni.close()


def _finished(client, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (job := client.get(f"/v1/videos/{job_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


@pytest.mark.parametrize("encoding", ["json", "multipart", "urlencoded"])
def test_a_vllm_omni_body_reaches_the_pipeline(served, encoding):
    ratio, shift = served.omni.pipeline.config.boundary_ratio, served.omni.pipeline.scheduler.config.flow_shift
    if encoding == "json":
        made = served.client.post("/v1/videos", json=VLLM_OMNI_BODY)
    elif encoding == "urlencoded":  # as vllm-omni's serving benchmark sends it (aiohttp's form without files)
        made = served.client.post("/v1/videos", data={name: str(value) for name, value in VLLM_OMNI_BODY.items()})
    else:  # as vllm-omni's examples send it (curl -F): every field a text part
        parts = {name: (None, str(value)) for name, value in VLLM_OMNI_BODY.items()}
        made = served.client.post("/v1/videos", files=parts)
    assert made.status_code == 200, made.text
    before = len(served.calls)
    job = _finished(served.client, made.json()["id"])
    assert job["status"] == "completed", job
    call = served.calls[before - 1] if len(served.calls) == before else served.calls[-1]
    expected = {
        "height": 48, "width": 32, "num_frames": 5, "num_inference_steps": 2, "negative_prompt": "blurry",
        "guidance_scale": 3.0, "guidance_scale_2": 2.0,
    }  # fmt: skip
    assert {name: call.kwargs[name] for name in expected} == expected
    assert (call.ratio, call.shift) == (0.5, 5.0)  # in force during the call
    pipeline = served.omni.pipeline
    assert (pipeline.config.boundary_ratio, pipeline.scheduler.config.flow_shift) == (ratio, shift)  # restored after

    settings = job["layerstream"]["settings"]
    assert {name: settings[name] for name in ("guidance_scale_2", "boundary_ratio", "flow_shift", "fps", "size")} == {
        "guidance_scale_2": 2.0, "boundary_ratio": 0.5, "flow_shift": 5.0, "fps": 8, "size": "32x48",
    }  # fmt: skip
    assert job["inference_time_s"] > 0 and job["peak_memory_mb"] > 0  # a CPU device: the process's peak
    assert settings["vae_decode"].startswith("untiled (vae_use_tiling auto")  # how it decoded, said with the settings


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"true_cfg_scale": 4.0}, 400, "true_cfg_scale"),  # WanPipeline's __call__ takes none: past the schema
        ({"width": 32}, 400, "height"),  # past the schema, which cannot say "both or neither"
        ({"width": 32, "height": 32, "size": "64x64"}, 400, "size"),
        ({"fps": 0}, 422, "fps"),
        ({"boundary_ratio": 1.5}, 422, "boundary_ratio"),
    ],
)
def test_a_field_the_pipeline_cannot_take_is_one_error_naming_it(served, body, status, param):
    before = len(served.calls)
    for path in ("/v1/videos", "/v1/videos/generations"):
        if path.endswith("generations") and "width" in body:
            continue  # width and height are the job API's (vllm-omni's); the synchronous endpoint takes size
        answer = served.client.post(path, json={"prompt": "fox", **body})
        assert answer.status_code == status, (path, answer.text)
        assert answer.json()["error"]["param"] == param, answer.text
    assert len(served.calls) == before
    refused = served.client.post("/v1/videos", json={"prompt": "fox", "true_cfg_scale": 4.0}).json()["error"]
    assert "WanPipeline" in refused["message"] and "true_cfg_scale" in refused["message"]


def test_a_url_encoded_body_gets_the_checks_and_error_bodies_of_the_other_encodings(served):
    for body, param in ([("prompt", "fox"), ("fps", "0")], "fps"), ([("prompt", "fox"), ("boundary_ratio", "1.5")], "boundary_ratio"):
        as_json = served.client.post("/v1/videos", json={name: float(v) if name != "prompt" else v for name, v in body})
        as_form = served.client.post("/v1/videos", files={name: (None, v) for name, v in body})
        encoded = served.client.post("/v1/videos", content="&".join(f"{k}={v}" for k, v in body), headers={"content-type": "application/x-www-form-urlencoded"})
        assert as_json.status_code == as_form.status_code == encoded.status_code == 422, encoded.text
        assert as_form.json()["error"] == encoded.json()["error"] and encoded.json()["error"]["param"] == param
    twice = served.client.post("/v1/videos", content="prompt=a&prompt=b", headers={"content-type": "application/x-www-form-urlencoded"})
    assert twice.status_code == 422 and twice.json()["error"]["param"] == "prompt"
    image = served.client.post("/v1/videos", data={"prompt": "fox", "input_reference": "aGVsbG8="})
    assert image.status_code == 422 and image.json()["error"]["param"] == "input_reference"


def test_videos_sync_answers_the_mp4_with_vllm_omnis_headers_and_stores_no_job(served):
    from jobs_harness import mp4_frames

    listed = len(served.client.get("/v1/videos", params={"limit": 100}).json()["data"])
    parts = {name: (None, str(value)) for name, value in VLLM_OMNI_BODY.items()}
    answer = served.client.post("/v1/videos/sync", files=parts)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "video/mp4"
    assert answer.headers["x-model"] == "tiny-wan" and len(answer.headers["x-request-id"]) == 32
    assert float(answer.headers["x-inference-time-s"]) > 0 and float(answer.headers["x-peak-memory-mb"]) > 0
    assert set(json.loads(answer.headers["x-stage-durations"])) == {"queue", "inference", "total"}
    assert len(served.client.get("/v1/videos", params={"limit": 100}).json()["data"]) == listed  # no job stored
    job = _finished(served.client, served.client.post("/v1/videos", files=parts).json()["id"])
    stored = served.client.get(f"/v1/videos/{job['id']}/content").content
    assert torch.equal(mp4_frames(answer.content), mp4_frames(stored))  # the job API's video, frame for frame
    too_long = served.client.post("/v1/videos/sync", json={**VLLM_OMNI_BODY, "num_frames": 10_001})
    as_job = served.client.post("/v1/videos", json={**VLLM_OMNI_BODY, "num_frames": 10_001})
    assert too_long.status_code == as_job.status_code and too_long.json()["error"] == as_job.json()["error"]


EXTRA_PARAMS = {"sample_solver": "euler", "max_sequence_length": 16}


@pytest.mark.parametrize("encoding", ["json", "multipart", "urlencoded", "generations"])
def test_extra_params_reach_the_call_in_every_encoding_and_the_job_records_them(served, encoding):
    from layerstream.outputs import read_output_metadata

    body = {**VLLM_OMNI_BODY, "extra_params": EXTRA_PARAMS}
    form = {name: json.dumps(value) if name == "extra_params" else str(value) for name, value in body.items()}
    before = len(served.calls)
    if encoding == "generations":  # a synchronous endpoint takes it as the jobs do
        sync = {**{k: v for k, v in body.items() if k not in ("width", "height")}, "size": "32x48"}
        assert served.client.post("/v1/videos/generations", json=sync).status_code == 200
    else:
        made = {
            "json": lambda: served.client.post("/v1/videos", json=body),
            "multipart": lambda: served.client.post("/v1/videos", files={k: (None, v) for k, v in form.items()}),
            "urlencoded": lambda: served.client.post("/v1/videos", data=form),
        }[encoding]()
        assert made.status_code == 200, made.text
        job = _finished(served.client, made.json()["id"])
        assert job["status"] == "completed", job
        assert job["layerstream"]["settings"]["extra_params"] == EXTRA_PARAMS
        assert read_output_metadata(served.data / "outputs" / f"{job['id']}.mp4")["extra_params"] == EXTRA_PARAMS
    (call,) = served.calls[before:]
    assert call.kwargs["max_sequence_length"] == 16 and "sample_solver" not in call.kwargs
    assert (call.scheduler, served.omni.pipeline.scheduler.__class__.__name__) == ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")


def test_extra_params_make_another_video_and_an_empty_object_the_same_one(served):
    from jobs_harness import mp4_frames

    def video(extra: dict) -> bytes:
        answer = served.client.post("/v1/videos/sync", json={**VLLM_OMNI_BODY, **extra})
        assert answer.status_code == 200, answer.text
        return mp4_frames(answer.content)

    plain = video({})
    assert torch.equal(video({"extra_params": {}}), plain)
    assert not torch.equal(video({"extra_params": {"sample_solver": "euler"}}), plain)


@pytest.mark.parametrize(
    "extra_params, param, said",
    [
        ("{bad", "extra_params", "extra_params is not valid JSON text"),  # a form's text that is no JSON
        ("[1]", "extra_params", "object"),
        ({"foo": 1}, "extra_params.foo", "one of the keys WanPipeline takes: attention_kwargs, max_sequence_length, sample_solver"),
        ({"sample_solver": "heun"}, "extra_params.sample_solver", "one of 'unipc', 'euler', 'dpm++'"),
        ({"num_inference_steps": 3}, "extra_params.num_inference_steps", "the num_inference_steps field itself"),
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "extra_params", "32 levels"),  # past the depth limit
    ],
)
def test_extra_params_the_model_cannot_take_are_a_400_naming_the_key(served, extra_params, param, said):
    as_text = extra_params if isinstance(extra_params, str) else json.dumps(extra_params)
    before, answers = len(served.calls), []
    for path in ("/v1/videos", "/v1/videos/sync"):  # the form endpoints: multipart and url-encoded
        answers.append(served.client.post(path, files={"prompt": (None, "fox"), "extra_params": (None, as_text)}))
        answers.append(served.client.post(path, data={"prompt": "fox", "extra_params": as_text}))
    if as_text != "{bad":  # and a JSON body on every endpoint
        for path in ("/v1/videos", "/v1/videos/sync", "/v1/videos/generations"):
            answers.append(served.client.post(path, json={"prompt": "fox", "extra_params": json.loads(as_text)}))
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and said in error["message"], error
    assert len(served.calls) == before


def test_json_text_nested_past_any_parser_is_a_400_naming_the_limit(served):
    """A form's ``extra_params`` nested 5,000 deep (a RecursionError and a 500 from about 500) is refused naming
    the depth limit before it is parsed; a JSON body that deep stops at its own parser's bound, a 400 too."""
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    before, answers = len(served.calls), []
    for path in ("/v1/videos", "/v1/videos/sync"):
        answers.append(served.client.post(path, files={"prompt": (None, "fox"), "extra_params": (None, deep)}))
        answers.append(served.client.post(path, data={"prompt": "fox", "extra_params": deep}))
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "extra_params" and "deeper than 32 levels" in error["message"], error
    body = b'{"prompt": "fox", "extra_params": ' + deep.encode() + b"}"
    answer = served.client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json", answer.text
    assert len(served.calls) == before
