"""A job's outcome is settled once: the bookkeeping after it (retention, metrics, event streams) can fail without
changing it, which is logged and shown on ``/health``; a full database is told by SQLite's result code, as a full
disk by ENOSPC; a database error marking one job of a wave in progress fails that job only; a second DELETE of a
deleted job is a 404, as a GET.

On a stand-in `Omni` (no model), with real SQLite failures where they can be made: a page limit
(``PRAGMA max_page_count``) fills the database as a full disk would, a trigger refuses a row."""

from __future__ import annotations

import errno
import sqlite3
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from layerstream.request import GenerationRequest
from layerstream.server.errors import ApiError
from layerstream.server.jobs.manager import JobManager, _is_full
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import JobStore
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from layerstream.server.stopping import StopReason
from serve_harness import wait_until
from test_job_manager_edges import BODY, _Omni

pytestmark = pytest.mark.fast

@pytest.fixture
def jobs(tmp_path):
    service = GenerationService(_Omni(), ServeSettings(port=0, shutdown_timeout=0))
    manager = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data", max_jobs=5)))
    service.start()
    yield manager
    assert service.stop()
    manager.close()


def _bookkeeping(jobs: JobManager) -> str:
    """What /health says of the bookkeeping, once it has run after the job that ended last (it follows the outcome)."""
    wait_until(lambda: jobs.health()["jobs_bookkeeping"] != "ok", what="the bookkeeping after the job")
    return jobs.health()["jobs_bookkeeping"]


def _ended(jobs: JobManager, job_id: str) -> dict:
    wait_until(lambda: jobs.get(job_id)["status"] in ("completed", "failed"), what=f"job {job_id} to end")
    return jobs.get(job_id)


def test_retention_that_fails_after_a_job_completed_leaves_it_completed(jobs, caplog):
    def broken_retention():
        raise sqlite3.OperationalError("disk I/O error")

    jobs.store.enforce_retention_ = broken_retention
    job = _ended(jobs, jobs.create(BODY, None)["id"])
    assert job["status"] == "completed" and job["error"] is None, job
    served, media_type, _ = jobs.content(job["id"])  # its file is there
    assert media_type == "image/png" and served.read_bytes().startswith(b"\x89PNG")
    jobs.release_content(served)
    state = _bookkeeping(jobs)
    assert state == f"retention after job {job['id']} completed raised OperationalError: disk I/O error", state
    assert any("the job's outcome stands" in r.getMessage() for r in caplog.records)


def test_metrics_or_event_streams_that_fail_after_the_outcome_leave_it_as_stored(jobs):
    record = jobs.metrics.record_job_state

    def broken_metrics(job_id: str, status: str) -> None:
        if status in ("completed", "failed"):
            raise RuntimeError("a metrics bug")
        record(job_id, status)

    jobs.metrics.record_job_state = broken_metrics
    job = _ended(jobs, jobs.create(BODY, None)["id"])
    assert job["status"] == "completed", job
    assert _bookkeeping(jobs) == f"announcing job {job['id']} as completed raised RuntimeError: a metrics bug"
    jobs.metrics.record_job_state = record
    publish = jobs.events.publish

    def broken_stream(job_id, event) -> None:
        if event.name == "status" and event.data.get("status") == "completed":
            raise RuntimeError("a stream bug")
        publish(job_id, event)

    jobs.events.publish = broken_stream
    jobs.bookkeeping_problem = None
    job = _ended(jobs, jobs.create(BODY, None)["id"])
    assert job["status"] == "completed", job
    assert _bookkeeping(jobs).endswith("raised RuntimeError: a stream bug")


def test_a_second_delete_is_a_404_as_a_get_even_while_the_job_still_runs(jobs):
    gate = threading.Event()
    jobs.service.omni.on_call = lambda index: gate.wait(30)  # the job runs until the test lets it go
    try:
        job_id = jobs.create(BODY, None)["id"]
        wait_until(lambda: jobs.get(job_id)["status"] == "in_progress", what="the job to start")
        assert jobs.delete(job_id)["deleted"] is True
        for again in (jobs.get, jobs.delete):
            with pytest.raises(ApiError) as gone:
                again(job_id)
            assert gone.value.status == 404
    finally:
        gate.set()
    wait_until(lambda: not jobs.service.queue.running, what="the deleted job to stop")


def test_a_delete_the_database_refuses_leaves_the_job_live_so_a_retry_stops_it(jobs, monkeypatch):
    gate = threading.Event()
    jobs.service.omni.on_call = lambda index: gate.wait(30)
    try:
        job_id = jobs.create(BODY, None)["id"]
        wait_until(lambda: jobs.get(job_id)["status"] == "in_progress", what="the job to start")
        stop_signal = jobs._live[job_id].queued.stop_signal
        delete = jobs.store.delete
        monkeypatch.setattr(jobs.store, "delete", lambda job: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")))
        with pytest.raises(sqlite3.OperationalError):
            jobs.delete(job_id)
        assert jobs.get(job_id)["status"] == "in_progress"  # still live: its progress, and a way to stop it
        monkeypatch.setattr(jobs.store, "delete", delete)
        assert stop_signal.reason is None  # not deleted: not stopped either
        assert jobs.delete(job_id)["deleted"] is True
        assert stop_signal.reason is StopReason.CANCELLED  # the retry stops the running job
    finally:
        gate.set()
    wait_until(lambda: not jobs.service.queue.running, what="the deleted job to stop")


# --- a full database --------------------------------------------------------------------------------------------


def test_a_full_database_is_told_by_sqlites_code_not_by_its_words(tmp_path):
    db = sqlite3.connect(tmp_path / "full.sqlite3")
    db.execute("CREATE TABLE t (x BLOB)")
    db.commit()
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(sqlite3.Error) as full:
        db.execute("INSERT INTO t VALUES (zeroblob(100000))")
    db.execute("PRAGMA max_page_count = 1073741823")
    db.execute("CREATE TRIGGER refuse BEFORE INSERT ON t BEGIN SELECT RAISE(ABORT, 'the table is full of foxes'); END")
    with pytest.raises(sqlite3.Error) as worded:
        db.execute("INSERT INTO t VALUES (1)")
    db.close()
    assert _is_full(full.value)
    assert not _is_full(worded.value)  # "full" in its words, but a constraint's code
    assert _is_full(OSError(errno.ENOSPC, "No space left on device")) and not _is_full(OSError(errno.EACCES, "denied"))
    without_code = sqlite3.OperationalError(str(full.value))  # as Python 3.10 raises it: no sqlite_errorcode
    assert getattr(without_code, "sqlite_errorcode", None) is None and _is_full(without_code)
    assert not _is_full(sqlite3.OperationalError("the table is full of foxes"))


@pytest.fixture
def client(tmp_path):
    from layerstream.server.app import create_app

    service = GenerationService(_Omni(), ServeSettings(port=0, shutdown_timeout=0))
    manager = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data")))
    with TestClient(create_app(service, manager, ui=False), base_url="http://127.0.0.1") as http:
        yield http, manager


def test_a_job_a_full_database_cannot_store_is_a_507_and_a_refusing_one_a_503(client):
    http, manager = client
    body = {"prompt": "a fox", "size": "16x16", "num_inference_steps": 1}
    connection = manager.store._db  # the store's own connection: a page limit is per connection
    (pages,) = connection.execute("PRAGMA page_count").fetchone()
    connection.execute(f"PRAGMA max_page_count = {pages}")
    refused = http.post("/v1/images/jobs", json={**body, "prompt": "x" * 9_000})
    assert refused.status_code == 507, refused.text
    assert refused.json()["error"]["code"] == "data_folder_full"
    connection.execute("PRAGMA max_page_count = 1073741823")
    with sqlite3.connect(manager.store.folder / "jobs.sqlite3") as other:
        other.execute("CREATE TRIGGER refuse BEFORE INSERT ON jobs BEGIN SELECT RAISE(ABORT, 'the disk is full of foxes'); END")
    other.close()
    refused = http.post("/v1/images/jobs", json=body)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "database_error", refused.text


# --- a wave -----------------------------------------------------------------------------------------------------


class _Refusing:
    """A job's observer whose job database refuses its in-progress status."""

    wants_latents = False

    def started(self) -> None:
        raise sqlite3.OperationalError("database is locked")


class _Following:
    wants_latents = False

    def __init__(self) -> None:
        self.num_started = 0

    def started(self) -> None:
        self.num_started += 1


def test_a_database_error_marking_one_job_of_a_wave_fails_that_job_only(monkeypatch):
    import layerstream.server.waves as waves
    from layerstream.server.queue import GenerationQueue
    from layerstream.server.ranks import RankOutcome
    from layerstream.server.served import ServedRequest

    sent = []

    def lead_wave(channel, runtime, message, decide, observer=None):
        sent.append(message)
        return [RankOutcome(rank, 0, results=[SimpleNamespace(files=[b"out"])] * len(w.requests)) for rank, w in enumerate(message.works)]

    monkeypatch.setattr(waves, "lead_wave", lead_wave)
    monkeypatch.setattr(waves, "job_output", lambda limits, metrics, job, result, **kwargs: ("output of", job.served.request.prompt))
    stats = SimpleNamespace(host_bytes=0)
    runtime = SimpleNamespace(setup=SimpleNamespace(world_size=2), omni=SimpleNamespace(stats=lambda: stats), host_bytes=lambda: 0)
    channel = SimpleNamespace(
        wait_for_ranks=lambda: None, broadcast=lambda message: message,
        gather=lambda outcome: [outcome, RankOutcome(1, 0)],
    )  # fmt: skip
    service = GenerationService(_Omni(), ServeSettings(port=0, shutdown_timeout=0))
    policy = waves.WavePolicy(num_ranks=2, max_batch_size=1, wait_seconds=0.0, max_cost=100, idle_seconds=60)
    runner = waves.RankRunner(runtime, channel, policy, service.limits, service.metrics)
    queue = GenerationQueue(4, runner=runner)  # not started: it only makes the jobs
    request = GenerationRequest(prompt="kept", width=16, height=16, num_inference_steps=2, seed=1)
    following = _Following()
    refused_job = queue.submit(ServedRequest(request=replace(request, prompt="refused"), work=1), observer=_Refusing())
    kept_job = queue.submit(ServedRequest(request=request, work=1), observer=following)

    refused, kept = runner.run([[refused_job], [kept_job]])
    assert isinstance(refused, sqlite3.OperationalError)  # the job manager fails it: database_error
    assert kept == ("output of", "kept") and following.num_started == 1
    # the wave ran the kept job alone (the other rank a placeholder of it), not the refused one
    assert [[r.prompt for r in work.requests] for work in sent[0].works] == [["kept"], ["kept"]]
    assert sent[0].works[1].placeholder
