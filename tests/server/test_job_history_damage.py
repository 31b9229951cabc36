"""A damaged job history degrades, never stops: every way a hand or a disk can damage a row (not JSON, truncated,
an unknown status, a record of ``{}``, fields of the wrong type, fields missing or null, NULL columns, a record
whose columns disagree with it, an output name outside the outputs folder) leaves startup and every list page
answering; the row is set aside, counted in ``/health``, named in the log, left in the database as it is, and a
GET or DELETE of it is a 404.

The app runs in this process (FastAPI's test client) on a stand-in model; the history is written through the
store, then damaged with sqlite3 as someone else would."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from layerstream.request import GenerationRequest
from layerstream.server.jobs.records import JobRecord, JobSettings, JobStatus
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import DATABASE_NAME, JobStore
from test_service import StandInOmni

pytestmark = pytest.mark.fast

JOBS = "/v1/images/jobs"
NUM_GOOD = 5


def _record(index: int, status: JobStatus = JobStatus.FAILED) -> JobRecord:
    return JobRecord(
        id=f"image_{index:032x}", kind="image", model="stand-in", status=status, created_at=1_700_000_000 + index,
        request=GenerationRequest(prompt=f"fox {index}", width=16, height=16, num_inference_steps=2, seed=index),
        settings=JobSettings(output_format="png"), completed_at=1_700_000_100 + index,
        error={"code": "stopped", "message": "a test record"},
        figures={"step": 1, "total": 2, "seconds_per_step": 0.5, "streamed_bytes": 0, "stall_seconds": 0.0},
    )  # fmt: skip


def _truncated(text: str) -> str:
    return text[: len(text) // 2]


def _with(**changes):
    return lambda text: json.dumps({**json.loads(text), **changes})


def _without(name: str):
    return lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != name})


# each damage: (the SQL run on the row, its parameters from the row's record text)
DAMAGES = {
    "not-json": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: "this is not JSON {"),
    "truncated": ("UPDATE jobs SET record = ? WHERE id = ?", _truncated),
    "binary-garbage": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: bytes(range(256))),
    "a-number": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: 42),
    "json-null": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: "null"),
    "empty-record": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: "{}"),
    "a-list": ("UPDATE jobs SET record = ? WHERE id = ?", lambda text: "[1, 2]"),
    "unknown-status": ("UPDATE jobs SET status = 'exploded', record = ? WHERE id = ?", _with(status="exploded")),
    "unknown-status-column": ("UPDATE jobs SET status = ? WHERE id = ?", lambda text: "exploded"),
    "created-at-text": ("UPDATE jobs SET record = ? WHERE id = ?", _with(created_at="yesterday")),
    "request-text": ("UPDATE jobs SET record = ? WHERE id = ?", _with(request="a fox")),
    "request-field-type": ("UPDATE jobs SET record = ? WHERE id = ?", lambda t: _with(request={**json.loads(t)["request"], "width": "wide"})(t)),
    "figures-text": ("UPDATE jobs SET record = ? WHERE id = ?", _with(figures={"seconds_per_step": "fast"})),
    "progress-bool": ("UPDATE jobs SET record = ? WHERE id = ?", _with(progress=True)),
    "settings-missing": ("UPDATE jobs SET record = ? WHERE id = ?", _without("settings")),
    "request-missing": ("UPDATE jobs SET record = ? WHERE id = ?", _without("request")),
    "id-null": ("UPDATE jobs SET record = ? WHERE id = ?", _with(id=None)),
    "status-null": ("UPDATE jobs SET record = ? WHERE id = ?", _with(status=None)),
    "unknown-field": ("UPDATE jobs SET record = ? WHERE id = ?", _with(colour="red")),
    "columns-disagree": ("UPDATE jobs SET record = ? WHERE id = ?", _with(id="image_" + "f" * 32)),
    "output-outside": ("UPDATE jobs SET record = ? WHERE id = ?", _with(output_name="../../jobs.sqlite3")),
}


def _history(folder: Path, num_queued: int = 0) -> list[str]:
    """A history of `NUM_GOOD` failed jobs and `num_queued` queued ones, written through the store; their ids."""
    store = JobStore(HistorySettings(data_dir=folder))
    records = [_record(i) for i in range(NUM_GOOD)] + [_record(NUM_GOOD + i, JobStatus.QUEUED) for i in range(num_queued)]
    for record in records:
        store.insert(record)
    store.close()
    return [record.id for record in records]


def _damage(folder: Path, job_id: str, name: str) -> None:
    sql, make = DAMAGES[name]
    with sqlite3.connect(folder / DATABASE_NAME) as db:
        (text,) = db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
        db.execute(sql, (make(text), job_id))
    db.close()


def _null_columns(folder: Path, job_id: str) -> None:
    """What a hand can do to the table itself: rebuild it without its NOT NULL constraints, then null a row."""
    with sqlite3.connect(folder / DATABASE_NAME) as db:
        db.executescript(f"""
            CREATE TABLE loose (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, kind TEXT, status TEXT,
                                output_bytes INTEGER DEFAULT 0, record TEXT);
            INSERT INTO loose SELECT * FROM jobs;
            DROP TABLE jobs;
            ALTER TABLE loose RENAME TO jobs;
            UPDATE jobs SET status = NULL, record = NULL, output_bytes = NULL WHERE id = '{job_id}';
        """)
    db.close()


def _rows(folder: Path) -> list[tuple]:
    with sqlite3.connect(folder / DATABASE_NAME) as db:
        rows = db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
    db.close()
    return rows


def _served(folder: Path):
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=folder)))
    return TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1")


def _every_page(http, order: str) -> list[str]:
    """The ids of every list page of one job each, following `after` to the end."""
    ids, after = [], None
    while True:
        page = http.get(JOBS, params={"limit": 1, "order": order, **({"after": after} if after else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        ids += [job["id"] for job in body["data"]]
        if not body["has_more"]:
            return ids
        after = body["last_id"]


@pytest.mark.parametrize("damage", [*DAMAGES, "null-columns"])
def test_a_damaged_row_is_set_aside_and_the_history_answers(tmp_path, caplog, damage):
    folder = tmp_path / "data"
    ids = _history(folder, num_queued=1)  # a queued job too: startup fails the unfinished ones
    damaged = ids[2]
    _null_columns(folder, damaged) if damage == "null-columns" else _damage(folder, damaged, damage)
    row_before = next(row for row in _rows(folder) if row[0] == 3)
    good = [job_id for job_id in ids if job_id != damaged]
    with caplog.at_level(logging.WARNING, logger="layerstream.server.jobs.store"), _served(folder) as http:
        assert _every_page(http, "desc") == good[::-1] and _every_page(http, "asc") == good
        assert http.get(JOBS, params={"limit": 100}).json()["data"][-1]["id"] == good[0]
        health = http.get("/health").json()
        assert health["jobs_unreadable"] == 1 and health["jobs_bookkeeping"] == "ok"
        assert http.get(f"{JOBS}/{damaged}").status_code == 404
        assert http.delete(f"{JOBS}/{damaged}").status_code == 404
        assert http.get(f"{JOBS}/{ids[-1]}").json()["status"] == "failed"  # the queued one, failed at startup
        created = http.post(JOBS, json={"prompt": "a new fox", "size": "16x16", "num_inference_steps": 1})
        assert created.status_code == 200, created.text  # and it keeps serving
    named = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(named) == 1 and "row 3" in named[0], named  # once, however often it was met
    assert next(row for row in _rows(folder) if row[0] == 3) == row_before  # left as it was


def test_every_damage_at_once_leaves_the_good_jobs_listed(tmp_path):
    folder = tmp_path / "data"
    store = JobStore(HistorySettings(data_dir=folder))
    records = [_record(i) for i in range(len(DAMAGES) + NUM_GOOD)]
    for record in records:
        store.insert(record)
    store.close()
    for record, damage in zip(records, DAMAGES):
        _damage(folder, record.id, damage)
    good = [record.id for record in records[len(DAMAGES) :]]
    with _served(folder) as http:
        assert _every_page(http, "desc") == good[::-1]
        page = http.get(JOBS, params={"limit": 3}).json()  # a full page, though many rows around it are damaged
        assert [job["id"] for job in page["data"]] == good[::-1][:3] and page["has_more"]
        assert http.get("/health").json()["jobs_unreadable"] == len(DAMAGES)


def test_a_row_damaged_while_the_server_runs_is_set_aside_when_met(tmp_path):
    folder = tmp_path / "data"
    ids = _history(folder)
    with _served(folder) as http:
        assert http.get("/health").json()["jobs_unreadable"] == 0
        _damage(folder, ids[0], "truncated")
        _damage(folder, ids[1], "empty-record")
        page = http.get(JOBS, params={"limit": NUM_GOOD - 2}).json()
        assert [job["id"] for job in page["data"]] == ids[2:][::-1] and not page["has_more"]
        assert http.get("/health").json()["jobs_unreadable"] == 2


def test_a_table_that_lost_a_column_is_refused_in_one_line_naming_it(tmp_path):
    from layerstream.server.jobs.store import JobStoreError

    folder = tmp_path / "data"
    _history(folder)
    with sqlite3.connect(folder / DATABASE_NAME) as db:
        db.execute("ALTER TABLE jobs DROP COLUMN output_bytes")
    db.close()
    with pytest.raises(JobStoreError, match="no column 'output_bytes'") as refused:
        JobStore(HistorySettings(data_dir=folder))
    assert "\n" not in str(refused.value) and "data_dir" in str(refused.value)
