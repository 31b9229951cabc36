"""A job's record is the `GenerationRequest` it runs plus its `JobSettings`; a history written before (version
1: every setting in one flat object) still reads, and shows the same job object."""

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

V1_SETTINGS = {
    "prompt": "a fox", "negative_prompt": None, "size": "32x16", "num_frames": 5, "fps": 16,
    "num_inference_steps": 2, "seed": 7, "guidance_scale": 3.5, "guidance_scale_2": None, "true_cfg_scale": None,
    "boundary_ratio": 0.5, "flow_shift": 3.0, "has_input_image": True, "model_revision": "main",
    "model_commit": "c" * 40,
}  # fmt: skip
"""The ``settings`` of a version 1 record, as that layerstream wrote them (and showed them on the job object)."""
V1_ROW = {
    "id": "video_" + "1" * 32, "kind": "video", "model": "tiny-wan", "status": "completed", "created_at": 1000,
    "settings": V1_SETTINGS, "seconds": "0.3125", "progress": 100, "completed_at": 1002, "error": None,
    "output_name": None, "output_bytes": 0, "figures": {"step": 2, "total": 2},
}  # fmt: skip
OLDEST_SETTINGS = {
    "prompt": "a cat", "negative_prompt": "blur", "size": "auto", "num_frames": None, "fps": None,
    "num_inference_steps": 4, "seed": 0, "guidance_scale": None, "has_input_image": False,
}  # fmt: skip
"""Version 1 before vllm-omni's fields and the model's revision were kept."""


def _version_1_history(folder, rows):
    """A data folder as a version 1 layerstream left it."""
    folder.mkdir()
    with sqlite3.connect(folder / "jobs.sqlite3") as db:
        db.execute(
            "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL,"
            " status TEXT NOT NULL, output_bytes INTEGER NOT NULL DEFAULT 0, record TEXT NOT NULL)"
        )
        for row in rows:
            db.execute(
                "INSERT INTO jobs (id, kind, status, output_bytes, record) VALUES (?, ?, ?, 0, ?)",
                (row["id"], row["kind"], row["status"], json.dumps(row)),
            )
        db.execute("PRAGMA user_version = 1")
    db.close()


def test_a_version_1_history_reads_as_requests_and_shows_the_same_job_objects(tmp_path):
    oldest = {**V1_ROW, "id": "image_" + "2" * 32, "kind": "image", "settings": OLDEST_SETTINGS, "seconds": None}
    _version_1_history(tmp_path / "data", [V1_ROW, oldest])
    store = JobStore(HistorySettings(data_dir=tmp_path / "data"))
    try:
        video, image = store.get(V1_ROW["id"]), store.get(oldest["id"])
        assert video.request == GenerationRequest(
            prompt="a fox", width=32, height=16, num_frames=5, fps=16, num_inference_steps=2, seed=7,
            guidance_scale=3.5, boundary_ratio=0.5, flow_shift=3.0,
        )  # fmt: skip
        assert video.settings == JobSettings(output_format="mp4", has_input_image=True, model_revision="main", model_commit="c" * 40)
        assert job_object(video, None, None)["layerstream"]["settings"] == V1_SETTINGS
        shown = job_object(image, None, None)
        assert shown["size"] == "auto" and shown["prompt"] == "a cat"
        assert shown["layerstream"]["settings"] == {
            **OLDEST_SETTINGS, "guidance_scale_2": None, "true_cfg_scale": None, "boundary_ratio": None,
            "flow_shift": None, "model_revision": None, "model_commit": None,
        }  # fmt: skip
        assert image.settings.output_format == "png"
        # a version 1 row written again (a status change) is written in the new form, and reads back the same
        assert store.update(video.with_status(JobStatus.FAILED, error={"code": "x", "message": "y"}))
        assert store.get(video.id) == video.with_status(JobStatus.FAILED, error={"code": "x", "message": "y"})
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "data" / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert json.loads(db.execute("SELECT record FROM jobs WHERE id = ?", (V1_ROW["id"],)).fetchone()[0])["version"] == 2
    db.close()


def test_a_record_is_its_request_and_job_settings_and_reads_back_equal(tmp_path):
    request = GenerationRequest(prompt="fox", width=16, height=16, num_inference_steps=3, seed=2**40, true_cfg_scale=4.0)
    record = JobRecord(
        id="image_" + "3" * 32, kind="image", model="tiny-flux", status=JobStatus.QUEUED, created_at=5,
        request=request, settings=JobSettings(output_format="png", preview=True),
    )  # fmt: skip
    stored = record.to_dict()
    assert stored["version"] == 2 and "image" not in stored["request"]  # the input image is never kept
    assert JobRecord.from_dict(json.loads(json.dumps(stored))) == record
    assert job_object(record, None, 1)["layerstream"]["settings"]["size"] == "16x16"


def test_a_history_newer_than_this_layerstream_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    with sqlite3.connect(tmp_path / "data" / "jobs.sqlite3") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(JobStoreError, match=f"schema version {SCHEMA_VERSION + 1} is newer"):
        JobStore(HistorySettings(data_dir=tmp_path / "data"))
