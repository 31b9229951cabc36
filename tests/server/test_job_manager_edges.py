"""`JobManager` on a stand-in `Omni`, at the moments where the worker, the event loop and the queue meet: a
drain while jobs wait, a delete just as a job starts or while its status is saved, jobs that fail under a
retention limit."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from layerstream.server.jobs.manager import JobManager
from layerstream.server.jobs.requests import ImageJobRequest
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import JobStore
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from serve_harness import wait_until
from test_service import StandInOmni

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

BODY = ImageJobRequest(prompt="a red fox", size="16x16", num_inference_steps=2)


class _Omni(StandInOmni):
    """The service's stand-in, with the offload config a completed job writes into its output."""

    config = SimpleNamespace(to_dict=lambda: {"mode": "layer", "components": ["dit"]})


@pytest.fixture
def make_jobs(tmp_path):
    made: list[JobManager] = []
    gate = threading.Event()  # set: generations run on; clear: each waits before its steps until set
    gate.set()

    def make(**history) -> JobManager:
        service = GenerationService(_Omni(), ServeSettings(port=0, shutdown_timeout=0))
        service.omni.on_call = lambda index: gate.wait(30)
        jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / f"data{len(made)}", **history)))
        service.start()
        made.append(jobs)
        return jobs

    make.gate = gate
    yield make
    gate.set()
    for jobs in made:
        assert jobs.service.stop()
        jobs.close()


def _status(jobs: JobManager, job_id: str) -> str:
    return jobs.get(job_id)["status"]


def _job_gauge(jobs: JobManager) -> dict[str, float]:
    text = jobs.service.render_metrics()
    found = {}
    for line in text.splitlines():
        if line.startswith('layerstream_jobs{status="'):
            labels, value = line.split(" ")
            found[labels.split('"')[1]] = float(value)
    return found


def test_a_queued_job_fails_at_once_when_the_server_drains_and_its_event_stream_ends(make_jobs):
    jobs = make_jobs()
    make_jobs.gate.clear()
    running = jobs.create(BODY, None)["id"]
    wait_until(lambda: _status(jobs, running) == "in_progress", what="the first job to start")
    queued = jobs.create(BODY, None)["id"]

    async def watch_through_drain() -> list[str]:
        stream = jobs.stream(queued)
        chunks = [await stream.__anext__()]  # subscribed: its status now (queued)
        jobs.service.drain()  # what SIGTERM does first, on the event loop: the queue fails its waiting jobs

        async def rest() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        await asyncio.wait_for(rest(), timeout=10)  # without a final status it would wait for the server's end
        return chunks

    chunks = asyncio.run(watch_through_drain())
    assert '"status": "queued"' in chunks[0]
    assert chunks[-1].startswith("event: status") and '"status": "failed"' in chunks[-1]
    job = jobs.get(queued)
    assert job["status"] == "failed" and job["error"]["code"] == "server_shutdown", job
    assert _job_gauge(jobs)["queued"] == 0
    make_jobs.gate.set()


def test_a_job_deleted_just_as_it_starts_is_let_go(make_jobs):
    from layerstream.server.stopping import GenerationStopped, StopReason

    jobs = make_jobs()
    start, started = jobs._started, []

    def deleted_as_it_starts(live):  # the queue has taken it; the worker has not marked it yet
        started.append(live.queued)
        jobs.delete(live.record.id)
        return start(live)

    jobs._started = deleted_as_it_starts
    made = jobs.create(BODY, None)["id"]
    wait_until(lambda: started and started[0].future.done(), what="the job's turn on the worker")
    # let go before its first output: stopped as deleted, nothing generated
    stopped = started[0].future.exception()
    assert isinstance(stopped, GenerationStopped) and stopped.reason is StopReason.CANCELLED
    assert "before output 1" in str(stopped) and jobs.service.omni.alive_at_start == []
    with pytest.raises(Exception, match="no image job"):
        jobs.get(made)
    assert made not in jobs._live  # nothing of the deleted job (its request, its input image) is held on to
    assert sum(_job_gauge(jobs).values()) == 0


def test_a_job_deleted_while_its_new_status_is_saved_leaves_no_state_on_metrics(make_jobs):
    jobs = make_jobs()
    record = jobs.metrics.record_job_state

    def deleted_between_store_and_metrics(job_id: str, status: str) -> None:
        if status == "in_progress":  # the store has it in progress; the event loop deletes it now
            jobs.delete(job_id)
        record(job_id, status)

    jobs.metrics.record_job_state = deleted_between_store_and_metrics
    made = jobs.create(BODY, None)["id"]
    wait_until(lambda: jobs.service.queue.num_started == 1 and not jobs.service.queue.running, what="the worker")
    jobs.metrics.record_job_state = record
    kept = jobs.create(BODY, None)["id"]
    wait_until(lambda: _status(jobs, kept) == "completed", what="the next job")
    assert jobs.store.get(made) is None
    assert _job_gauge(jobs) == {"queued": 0, "in_progress": 0, "completed": 1, "failed": 0}


def test_failed_jobs_are_held_to_the_retention_limit_too(make_jobs):
    jobs = make_jobs(max_jobs=2)

    def fail(index: int) -> None:
        raise RuntimeError("out of memory in a block")

    jobs.service.omni.on_call = fail
    made = [jobs.create(BODY, None)["id"] for _ in range(3)]
    # the status is stored first and retention runs after it: wait for both (a limit never applied times out)
    wait_until(
        lambda: _status(jobs, made[-1]) == "failed" and jobs.store.get(made[0]) is None and _job_gauge(jobs)["failed"] == 2,
        what="the last job's failure and the oldest job's removal",
    )
    kept = [job["id"] for job in jobs.page(limit=10, after=None, order="asc")["data"]]
    assert kept == made[1:]
    assert all(_status(jobs, job_id) == "failed" for job_id in kept)
    assert _job_gauge(jobs)["failed"] == 2


def test_opening_the_history_removes_only_the_files_it_wrote(tmp_path):
    """--data-dir may name a folder that already holds an outputs/ of someone else's (another tool's results):
    only job outputs no job names, and temporary files of job outputs, are removed when the store opens."""
    outputs = tmp_path / "data" / "outputs"
    outputs.mkdir(parents=True)
    theirs = [outputs / "fox.mp4", outputs / "image_notes.txt", outputs / ".hidden.png"]
    ours = [outputs / f"image_{'0' * 32}.png", outputs / f".video_{'a' * 32}.partial-1a2b3c4d.mp4"]
    for path in theirs + ours:
        path.write_bytes(b"x")
    store = JobStore(HistorySettings(data_dir=tmp_path / "data"))
    try:
        store.recover_()  # what the job manager does first
        assert [path.exists() for path in theirs] == [True, True, True]
        assert [path.exists() for path in ours] == [False, False]  # no job names them: a kill left them
    finally:
        store.close()


def test_a_job_deleted_while_its_output_downloads_keeps_sending_the_bytes(make_jobs):
    """The content route sends the store's link for that download: a DELETE meanwhile removes the job and its
    file name, not the bytes being sent; the link goes when the response ends; a later request is 404."""
    from layerstream.server.errors import ApiError

    jobs = make_jobs()
    job_id = jobs.create(BODY, None)["id"]
    wait_until(lambda: _status(jobs, job_id) == "completed", what="the job to complete")
    output = jobs.store.output_path(jobs.store.get(job_id))
    expected = output.read_bytes()
    served, media_type, name = jobs.content(job_id)
    assert (media_type, name) == ("image/png", output.name) and served != output
    with served.open("rb") as sending:  # the response has begun
        jobs.delete(job_id)
        assert not output.exists()
        assert sending.read() == expected
    jobs.release_content(served)
    assert list(jobs.store.serving.iterdir()) == []
    with pytest.raises(ApiError) as gone:
        jobs.content(job_id)
    assert gone.value.status == 404


def test_links_left_by_a_stopped_server_are_removed_at_start(tmp_path):
    store = JobStore(HistorySettings(data_dir=tmp_path))
    left = store.serving / f"{'0' * 32}-image_{'ab' * 8}.png"
    left.write_bytes(b"a download cut by a kill")
    other = store.serving / "notes.txt"  # not one of ours: kept
    other.write_text("x")
    store.recover_()
    store.close()
    assert not left.exists() and other.exists()


@pytest.mark.parametrize("refused", ["file", "row"])
def test_a_job_whose_outcome_cannot_be_stored_still_ends_failed(make_jobs, refused):
    """Storing a finished job's outcome runs in its future's callback, where an exception would only be logged:
    the output file refused (a full disk), or its row refused by the database (then its failure too, kept in
    memory), the job still ends, failed, naming why."""
    import errno
    import sqlite3

    jobs = make_jobs()
    if refused == "file":

        def write_output(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        jobs.store.write_output = write_output
    else:
        update = jobs.store.update

        def refuse_finished(record):
            if record.status.finished:
                raise sqlite3.OperationalError("database or disk is full")
            return update(record)

        jobs.store.update = refuse_finished
    made = jobs.create(BODY, None)["id"]
    wait_until(lambda: made not in jobs._live, what="the job's outcome to be recorded")  # its callback has run
    job = jobs.get(made)
    code = {"file": "output_write_failed", "row": "database_error"}[refused]
    assert job["status"] == "failed" and job["error"]["code"] == code, job
    assert job["error"]["message"].startswith({"file": "its output could not be written", "row": "the job database refused its row"}[refused])
    assert jobs.health()["jobs_storage"] != "ok"
