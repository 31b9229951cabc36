"""A job's record is the `GenerationRequest` it runs plus its `JobSettings`; a history of another schema version
is refused, naming it."""

from __future__ import annotations

import json
import sqlite3

import pytest

from layerstream.request import GenerationRequest
from layerstream.server.jobs.records import JobRecord, JobSettings, JobStatus, job_object
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import SCHEMA_VERSION, JobStore, JobStoreError



@pytest.mark.fast  # a unit or contract test: no process, no socket (tests/conftest.py checks)
def test_a_record_is_its_request_and_job_settings_and_reads_back_equal(tmp_path):
    request = GenerationRequest(prompt="fox", width=16, height=16, num_inference_steps=3, seed=2**40, true_cfg_scale=4.0)
    record = JobRecord(
        id="image_" + "3" * 32, kind="image", model="tiny-flux", status=JobStatus.QUEUED, created_at=5,
        request=request, settings=JobSettings(output_format="png", preview=True),
    )  # fmt: skip
    stored = record.to_dict()
    assert "image" not in stored["request"]  # the input image is never kept
    assert JobRecord.from_dict(json.loads(json.dumps(stored))) == record
    assert job_object(record, None, 1)["layerstream"]["settings"]["size"] == "16x16"
    assert job_object(record, None, 1)["layerstream"]["settings"]["vae_decode"] is None  # not run yet
    done = record.with_status(JobStatus.COMPLETED, figures={"vae_decode": "tiled (vae_use_tiling auto: ...)"})
    assert job_object(done, None, None)["layerstream"]["settings"]["vae_decode"] == "tiled (vae_use_tiling auto: ...)"


@pytest.mark.fast  # a unit or contract test: no process, no socket (tests/conftest.py checks)
@pytest.mark.parametrize(
    "version, refusal", [(SCHEMA_VERSION + 1, "is newer"), (SCHEMA_VERSION - 1, "is a development version's")]
)
def test_a_history_of_another_schema_version_is_refused(tmp_path, version, refusal):
    (tmp_path / "data").mkdir()
    with sqlite3.connect(tmp_path / "data" / "jobs.sqlite3") as db:
        db.execute(f"PRAGMA user_version = {version}")
    db.close()
    with pytest.raises(JobStoreError, match=f"schema version {version} {refusal}"):
        JobStore(HistorySettings(data_dir=tmp_path / "data"))


@pytest.mark.fast  # a unit or contract test: no process, no socket (tests/conftest.py checks)
def test_the_eta_counts_the_decode_and_is_never_zero_while_the_job_runs(monkeypatch):
    from layerstream.server.jobs import records
    from layerstream.server.jobs.records import AfterStepsRate, LiveProgress

    clock = [100.0]
    monkeypatch.setattr(records.time, "monotonic", lambda: clock[0])
    rate = AfterStepsRate()
    first = LiveProgress(step=2, total_steps=4, step_seconds=[0.6, 0.1])
    assert first.seconds_per_step == 0.1  # the first step's warm-up left out
    assert first.eta_seconds == pytest.approx(0.2)  # no job has finished: the decode is not known yet
    first.step, first.step_seconds, first.steps_done_at = 4, [0.6, 0.1, 0.1, 0.1], clock[0]
    assert first.eta_seconds is None  # decoding, for how long not known: not 0
    clock[0] += 8.0
    rate.learn(first, pixels=256 * 256 * 33)  # 8 s after the last step: the decode and the file
    second = LiveProgress(step=1, total_steps=4, step_seconds=[0.6], after_steps_seconds=rate.estimate(256 * 256 * 33))
    assert second.eta_seconds == pytest.approx(3 * 0.6 + 8.0)
    second.step, second.steps_done_at = 4, clock[0]
    clock[0] += 6.0
    assert second.eta_seconds == pytest.approx(2.0)  # the decode's part still ahead
    clock[0] += 3.0
    assert second.eta_seconds is None  # overdue: not known, never 0
    assert rate.estimate(128 * 128 * 33) == pytest.approx(2.0) and rate.estimate(None) is None


def test_the_first_jobs_eta_plans_the_decode_from_its_traced_flops_during_and_after_the_steps(tmp_path):
    from layerstream.omni import Omni
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.requests import VideoJobRequest
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings
    from serve_harness import wait_until

    omni = Omni("tiny-wan", device="cpu")
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data")))
    seen: dict[str, list[dict]] = {"steps": [], "decode": []}
    job_id = ""
    publish, vae_decode = jobs._publish_progress, omni.pipeline.vae.decode

    def published(live, percent):
        publish(live, percent)
        seen["steps"].append(jobs.get(job_id)["layerstream"])

    def decoding(*args, **kwargs):
        seen["decode"].append(jobs.get(job_id)["layerstream"])
        return vae_decode(*args, **kwargs)

    jobs._publish_progress, omni.pipeline.vae.decode = published, decoding
    service.start()
    try:
        body = VideoJobRequest(prompt="a red fox", size="64x64", num_frames=9, num_inference_steps=3)
        job_id = jobs.create(body, None)["id"]
        wait_until(lambda: jobs.get(job_id)["status"] in ("completed", "failed"), timeout=600, what="the job to end")
        assert jobs.get(job_id)["status"] == "completed", jobs.get(job_id)["error"]
    finally:
        assert service.stop()
        jobs.close()
        omni.close()
    second = next(s for s in seen["steps"] if s["step"] == 2)  # the steady rate is known from the second step
    assert second["eta_seconds"] > second["seconds_per_step"] * (second["total_steps"] - 2)  # the decode's share in it
    assert seen["decode"] and seen["decode"][0]["eta_seconds"] > 0  # decoding: its planned part still ahead, not 0
