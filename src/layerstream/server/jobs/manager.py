"""`JobManager`: jobs checked as synchronous requests are, stored as queued, run on the service's worker with a
`StepObserver` (progress and preview events), and their outputs written to the data folder. Once a job's
row says completed or failed its outcome is settled: the bookkeeping after it (metrics, events, retention)
may fail without changing it (logged, and `/health`'s ``jobs_bookkeeping``). A deleted job is gone at once;
a running one stops at its next step (`StopReason.CANCELLED`)."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from layerstream.request import GenerationError
from layerstream.server.errors import ApiError, client_line
from layerstream.server.jobs.events import JobEvent, JobEvents, stream_events
from layerstream.outputs import OutputEncoding
from layerstream.server.jobs.previews import LatentProjection, fit_latent_projection
from layerstream.server.jobs.records import (
    DECODED_PERCENT,
    AfterStepsRate,
    JobRecord,
    JobSettings,
    JobStatus,
    LiveProgress,
    job_object,
    planned_decode_steps,
    run_figures,
)
from layerstream.server.jobs.requests import ImageJobRequest, VideoJobRequest, seconds_shown
from layerstream.server.jobs.store import JobStore
from layerstream.server.queue import Job, QueueClosedError, QueueFullError
from layerstream.server.served import GenerationOutput
from layerstream.server.service import GenerationService, ServedRequest
from layerstream.server.stopping import GenerationStopped, StopReason

logger = logging.getLogger(__name__)

PREVIEWS_PER_JOB = 10  # about this many previews over a job's steps (every step for 10 steps or fewer)
MAX_PAGE = 100
DEFAULT_PAGE = 20


@dataclass(eq=False)
class _LiveJob:
    """A job this server process queued and has not finished: what the worker and the API share."""

    record: JobRecord
    served: ServedRequest  # `record.request` with its input image, and its output's encoding
    progress: LiveProgress = field(default_factory=LiveProgress)
    queued: Job | None = None
    stats_before: Any = None

    def failed(self, code: str, message: str) -> JobRecord:
        error = {"code": code, "message": message}
        return self.record.with_status(JobStatus.FAILED, error=error, completed_at=int(time.time()),
                                       figures=self.progress.figures())  # fmt: skip


class JobManager:
    """The job API of one `GenerationService` over one `JobStore`."""

    def __init__(self, service: GenerationService, store: JobStore):
        self.service = service
        self.store = store
        self.kind = service.limits.kind
        self.after_steps = AfterStepsRate()
        self.events = JobEvents()
        self._lock = threading.Lock()
        self._live: dict[str, _LiveJob] = {}
        self._unstored: dict[str, JobRecord] = {}  # ended while the database refused their row
        self.storage_problem: str | None = None  # the data folder's last refusal, for /health
        self.bookkeeping_problem: str | None = None  # the last bookkeeping after a settled outcome that failed
        # stores the outcomes of jobs a drain fails on the event loop: off the loop, in order
        self._off_loop = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-job-outcomes")
        self.metrics = service.metrics
        store.recover_()
        for job_id, status in store.statuses():  # the history's jobs count in layerstream_jobs from the start
            self.metrics.record_job_state(job_id, status)

    @property
    def _folders(self) -> dict[str, str]:  # named by their setting in answers (`client_line`)
        return {str(self.store.folder): "--data-dir"}

    @property
    def path(self) -> Literal["/v1/videos", "/v1/images/jobs"]:
        return "/v1/videos" if self.kind == "video" else "/v1/images/jobs"

    def close(self) -> None:
        """After the worker stopped: fail each job still live (left behind by the stop), then close the store."""
        self._off_loop.shutdown(wait=True)  # first: the jobs the drain failed are stored off the loop
        with self._lock:
            left = list(self._live.values())
            self._live.clear()
        for live in left:
            error = {"code": "server_shutdown", "message": "the server shut down before the job finished"}
            self.store.update(live.record.with_status(JobStatus.FAILED, error=error, completed_at=int(time.time())))
        self.store.close()

    def create(self, body: VideoJobRequest | ImageJobRequest, image: Any) -> dict[str, Any]:
        """Check `body`, store it as a queued job and queue it; its job object. A refusal stores nothing."""
        served = self.service.prepare(body.generation_body(self.service.limits), image, body.image_field)
        record = self._new_record(body, served)
        # the output carries the settings that make it again (`Omni`'s) and the job's id, written as it is
        # encoded (PNG text chunks, the MP4's comment): nothing is decoded or remuxed afterwards
        served = replace(served, encoding=OutputEncoding(record.settings.output_format, job_id=record.id))
        live = _LiveJob(record=record, served=served)
        try:
            self.store.insert(record)
        except (sqlite3.Error, OSError) as e:  # nothing stored, nothing queued: a refusal that says why
            raise self._storage_refusal(e) from None
        self.storage_problem = None
        self.metrics.record_job_state(record.id, record.status)
        with self._lock:
            self._live[record.id] = live  # before queueing: the worker may start it at once
        try:
            live.queued = self.service.submit(served, _JobObserver(self, live))
        except (QueueFullError, QueueClosedError) as e:
            with self._lock:
                self._live.pop(record.id, None)
            self.store.delete(record.id)
            self.metrics.forget_job(record.id)
            if isinstance(e, QueueFullError):
                raise ApiError(429, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
            raise ApiError(503, str(e), code="shutting_down") from None
        live.queued.future.add_done_callback(lambda future: self._answered(live, future))
        logger.info("job %s queued (prompt %r)", record.id, record.request.prompt[:80])
        return self._object(record, live)

    def get(self, job_id: str) -> dict[str, Any]:
        found = self._object_or_none(job_id)
        if found is None:
            raise _not_found(self.kind, job_id)
        return found

    def page(self, *, limit: int, after: str | None, order: Literal["asc", "desc"]) -> dict[str, Any]:
        found = self.store.page(self.kind, limit=limit, after=after, order=order)
        if found is None:
            raise ApiError(400, f"after = {after!r} names no {self.kind} job of this server", code="invalid_request", param="after")
        records, has_more = found
        data = [self._object(record, self._live_of(record.id)) for record in records]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}

    def delete(self, job_id: str) -> dict[str, Any]:
        """Remove the job and its output; a queued one never runs, a running one stops at its next step."""
        with self._lock:  # no longer live for the API: a second DELETE finds nothing, as a GET does
            live = self._live.pop(job_id, None)
        try:
            record = self.store.delete(job_id)
        except BaseException:  # not deleted (a locked or failing database): still live, so a retry can stop it
            if live is not None:
                with self._lock:
                    self._live.setdefault(job_id, live)
            raise
        with self._lock:
            unstored = self._unstored.pop(job_id, None)
        if record is None and live is None and unstored is None:
            raise _not_found(self.kind, job_id)
        if live is not None and live.queued is not None:
            # waiting: it never starts; running: it stops at its next step (the worker holds `live` till then)
            self.service.queue.stop(live.queued, StopReason.CANCELLED)
        self.metrics.forget_job(job_id)
        self.events.publish(job_id, JobEvent("status", {"id": job_id, "deleted": True}))
        logger.info("job %s deleted", job_id)
        return {"id": job_id, "object": f"{self.kind}.deleted", "deleted": True}

    def content(self, job_id: str) -> tuple[Path, str, str]:
        """(a link to send, its media type, the output's name) of a completed job; 404, or 409 before it completed.
        The caller gives the link back with `release_content` once the response has ended."""
        record = self.store.get(job_id)
        if record is None:
            raise _not_found(self.kind, job_id)
        path = self.store.output_path(record)
        if record.status is not JobStatus.COMPLETED or path is None:
            raise ApiError(409, f"{self.kind} job {job_id} is {record.status}: it has no content yet", code="not_completed")
        served = self.store.serve_output(record)
        if served is None:  # deleted between the lookup and the link
            raise _not_found(self.kind, job_id)
        return served, "video/mp4" if record.kind == "video" else "image/png", path.name

    def release_content(self, served: Path) -> None:
        self.store.release_served(served)

    def stream(self, job_id: str) -> AsyncIterator[str]:
        """The job's event stream; call `get` first (off the event loop) for a 404 before it starts."""
        return stream_events(self.events, job_id, lambda: self._object_or_none(job_id))

    def _started(self, live: _LiveJob) -> LatentProjection | None:
        """On the worker: mark the job in progress; the latent projection of its previews, if any."""
        if not self._save(live, live.record.with_status(JobStatus.IN_PROGRESS)):
            return None
        live.progress.total_steps = live.served.request.num_inference_steps or 0
        live.progress.after_steps_seconds = self.after_steps.estimate(_pixels(live))
        if live.progress.after_steps_seconds is None:  # no decode timed yet: planned from its traced FLOPs
            live.progress.decode_steps = planned_decode_steps(getattr(self.service.omni, "pipeline", None), live.served.request)
        live.stats_before = self.service.omni.stats()
        return self._latent_projection if live.record.settings.preview else None

    def _answered(self, live: _LiveJob, future: Any) -> None:
        """The future's callback: `_finished` here on the worker, or off the event loop for a job a drain failed."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs here: the worker thread
            self._finished(live, future)
        else:
            self._off_loop.submit(self._finished, live, future)

    def _finished(self, live: _LiveJob, future: Any) -> None:
        """Record the job's outcome; a failure to store it fails the job instead, so that every job ends."""
        try:
            self._record_outcome(live, future)
        except Exception as e:  # noqa: BLE001 - a job must end whatever went wrong in storing it
            self._fail_unstored(live, e)
        finally:
            with self._lock:
                self._live.pop(live.record.id, None)

    def _record_outcome(self, live: _LiveJob, future: Any) -> None:
        if future.cancelled():
            return  # deleted while it waited
        error = future.exception()
        if error is None:
            output: GenerationOutput = future.result()
            self._publish_progress(live, DECODED_PERCENT)
            self._complete(live, output.files[0], output.usage)
        elif isinstance(error, QueueClosedError):
            self._fail(live, "server_shutdown", "the server shut down before the job started")
        elif isinstance(error, GenerationStopped):
            if error.reason is not StopReason.CANCELLED:  # cancelled: already deleted, nothing to record
                self._fail(live, "stopped", str(error))
        elif isinstance(error, GenerationError):
            self._fail(live, "invalid_for_model", str(error))
        elif isinstance(error, ApiError):  # a serving rank was lost
            self._fail(live, error.code, error.message)
        elif isinstance(error, sqlite3.Error):  # marking it in progress failed: it never ran
            self._fail(live, "database_error", f"the job database refused a write: {error}")
        else:  # the runner logged the traceback
            self._fail(live, "generation_failed", client_line(error, self._folders))

    def _fail_unstored(self, live: _LiveJob, error: Exception) -> None:
        """Fail a job whose outcome could not be stored: in the database if it takes the row, else in memory."""
        code = "database_error" if isinstance(error, sqlite3.Error) else "output_write_failed" if isinstance(error, OSError) else "internal_error"
        what = {"database_error": "the job database refused its row", "output_write_failed": "its output could not be written"}
        message = f"{what.get(code, 'storing its outcome failed')}: {client_line(error, self._folders)}"
        logger.error("job %s failed: %s", live.record.id, message, exc_info=error)
        self.storage_problem = message
        try:
            self._fail(live, code, message)
            return
        except Exception as again:  # noqa: BLE001 - the database refuses this write too
            logger.error("job %s: its failure cannot be stored either (%s); it is kept in memory", live.record.id, again)
        failed = live.failed(code, message)
        with self._lock:
            self._unstored[failed.id] = failed
        live.record = failed
        self.metrics.record_job_state(failed.id, failed.status)
        self.events.publish(failed.id, JobEvent("status", self._object(failed, live)))

    def _storage_refusal(self, error: Exception) -> ApiError:
        """The answer to a job the data folder cannot store (and what `/health` says until a write succeeds)."""
        logger.error("the data folder %s refused a write: %s", self.store.folder, error)  # the path: in the log only
        if _is_full(error):
            self.storage_problem = f"the data folder (--data-dir) is full ({client_line(error, self._folders)})"
            return ApiError(507, f"{self.storage_problem}: the job cannot be stored; free space there", code="data_folder_full")
        self.storage_problem = f"the data folder (--data-dir) refused a write ({client_line(error, self._folders)})"
        return ApiError(503, f"{self.storage_problem}: the job was not stored; retry later", code="database_error")

    def health(self) -> dict[str, Any]:
        return {"jobs_path": self.path, "jobs_storage": self.storage_problem or "ok",
                "jobs_unreadable": len(self.store.unreadable), "jobs_bookkeeping": self.bookkeeping_problem or "ok"}

    def _complete(self, live: _LiveJob, data: bytes, usage: Any) -> None:
        """Store the job's file: encoded once by the worker, with the job's settings already inside it."""
        record = live.record
        self.after_steps.learn(live.progress, _pixels(live))
        name, size = self.store.write_output(record.id, f".{record.settings.output_format}", lambda p: p.write_bytes(data))
        done = record.with_status(
            JobStatus.COMPLETED, progress=100, completed_at=int(time.time()), output_name=name, output_bytes=size,
            figures={**live.progress.figures(), **run_figures(usage)},
        )  # fmt: skip
        try:
            saved = self._save(live, done)
        except BaseException:
            self.store.remove_output(name)  # no row names it: it would be an orphan
            raise
        if not saved:
            self.store.remove_output(name)  # deleted while its file was written
            return
        self.storage_problem = None  # its file and its row were written
        logger.info("job %s completed (%d bytes)", record.id, size)
        self._after_outcome(f"retention after job {record.id} completed", self._enforce_retention)

    def _fail(self, live: _LiveJob, code: str, message: str) -> None:
        logger.info("job %s failed: %s", live.record.id, message)
        failed = live.failed(code, message)
        if self._save(live, failed):  # failed jobs count against the limits as completed ones do
            self._after_outcome(f"retention after job {failed.id} failed", self._enforce_retention)

    def _enforce_retention(self) -> None:
        for removed in self.store.enforce_retention_():
            self.metrics.forget_job(removed)

    def _save(self, live: _LiveJob, record: JobRecord) -> bool:
        """Store a new status and announce it; False if the job was deleted meanwhile."""
        if not self.store.update(record):
            return False
        live.record = record
        announced = self._after_outcome(f"announcing job {record.id} as {record.status}", lambda: self._announce(live, record))
        return announced is not False

    def _announce(self, live: _LiveJob, record: JobRecord) -> bool:
        """A stored status told to the metrics and the job's event streams; False if the job was deleted."""
        self.metrics.record_job_state(record.id, record.status)
        if self.store.get(record.id) is None:  # deleted between the two: its forget_job may have come first
            self.metrics.forget_job(record.id)
            return False
        self.events.publish(record.id, JobEvent("status", self._object(record, live)))
        return True

    def _after_outcome(self, what: str, action: Callable[[], Any]) -> Any:
        """`action()` after a stored status: a failure is logged and shown on `/health`, never raised (None)."""
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - the outcome is stored; nothing after it may change it
            problem = f"{what} raised {client_line(e, self._folders)}"  # shown on /health: no path
            logger.error("%s (the job's outcome stands)", problem, exc_info=e)
            self.bookkeeping_problem = problem
            return None

    def _publish_progress(self, live: _LiveJob, percent: int) -> None:
        live.record = live.record.with_status(live.record.status, progress=percent)
        self.events.publish(live.record.id, JobEvent("progress", live.progress.event(percent)))

    @functools.cached_property
    def _latent_projection(self) -> LatentProjection | None:  # once, on the worker thread, before the pipeline runs
        return fit_latent_projection(self.service.omni.pipeline)

    def _new_record(self, body: VideoJobRequest | ImageJobRequest, served: ServedRequest) -> JobRecord:
        """The queued job: the request `served` runs, without its input image."""
        request, source = served.request, self.service.source
        settings = JobSettings(
            output_format="mp4" if self.kind == "video" else "png", preview=body.preview,
            has_input_image=request.image is not None, model_revision=source.to_dict().get("revision"),
            model_commit=source.commit,
        )  # fmt: skip
        seconds = None
        if isinstance(body, VideoJobRequest) and request.fps:
            seconds = seconds_shown(body, request.num_frames or 0, request.fps)
        return JobRecord(
            id=f"{self.kind}_{secrets.token_hex(16)}", kind=self.kind, model=self.service.limits.model,
            status=JobStatus.QUEUED, created_at=int(time.time()), request=replace(request, image=None),
            settings=settings, seconds=seconds,
        )  # fmt: skip

    def _live_of(self, job_id: str) -> _LiveJob | None:
        with self._lock:
            return self._live.get(job_id)

    def _object_or_none(self, job_id: str) -> dict[str, Any] | None:
        live = self._live_of(job_id)
        record = self.store.get(job_id)
        return None if record is None else self._object(record, live)

    def _object(self, record: JobRecord, live: _LiveJob | None) -> dict[str, Any]:
        with self._lock:
            record = self._unstored.get(record.id, record)  # it ended, though its row could not say so
        if live is not None and not record.status.finished:
            record = live.record  # the live progress, newer than what is stored
        position = None
        if live is not None and live.queued is not None and record.status is JobStatus.QUEUED:
            position = self.service.queue.position(live.queued)
        return job_object(record, live.progress if live is not None else None, position)


class _JobObserver:
    """A job's `StepObserver`: in progress when it starts, progress after every step, a preview every few."""

    def __init__(self, manager: JobManager, live: _LiveJob):
        self.manager = manager
        self.live = live
        self.projection: LatentProjection | None = None
        self.wants_latents = False

    def started(self) -> None:
        self.projection = self.manager._started(self.live)
        self.wants_latents = self.projection is not None

    def stepped(self, step: int, total: int, seconds: float, stats: Any) -> None:
        progress, before = self.live.progress, self.live.stats_before
        progress.step, progress.total_steps = step, total
        progress.step_seconds.append(seconds)
        if step >= total:
            progress.steps_done_at = time.monotonic()
        if stats is not None and before is not None:
            progress.streamed_bytes = stats.bytes_transferred - before.bytes_transferred
            progress.stall_seconds = stats.stall_seconds - before.stall_seconds
        self.manager._publish_progress(self.live, progress.percent())

    def latents(self, step: int, total: int, latents: Any) -> None:
        every = max(1, total // PREVIEWS_PER_JOB)
        job_id = self.live.record.id
        if self.projection is None or (step % every and step != total) or not self.manager.events.wants(job_id):
            return
        width, height = self.live.record.request.width, self.live.record.request.height
        if not (width and height):
            return  # the pipeline picks its size: the packed latents cannot be laid out without it
        image = self.projection.preview_data_url(latents, width=width, height=height)
        self.manager.events.publish(job_id, JobEvent("preview", {"step": step, "image": image}))


def _is_full(error: Exception) -> bool:
    """Whether `error` says the disk or the database is full: ENOSPC, or SQLITE_FULL (by its text on Python 3.10)."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    if not isinstance(error, sqlite3.Error):
        return False
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11 and later
    if code is None:
        return str(error) == "database or disk is full"  # sqlite3_errstr(SQLITE_FULL)
    return code & 0xFF == _SQLITE_FULL  # the primary code is the low byte of an extended one


_SQLITE_FULL = getattr(sqlite3, "SQLITE_FULL", 13)


def _pixels(live: _LiveJob) -> int | None:
    request = live.record.request
    if not (request.width and request.height):
        return None
    return request.width * request.height * (request.num_frames or 1)


def _not_found(kind: str, job_id: str) -> ApiError:
    return ApiError(404, f"no {kind} job {job_id!r} on this server", code="not_found", param="id")
