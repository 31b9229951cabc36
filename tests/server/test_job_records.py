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

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


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
