"""A bounded FIFO of jobs, run one at a time by exactly one worker thread.

One thread, not a pool: the offload runtime refuses a second thread entering a streamed model while one
runs it (the blocks share one ring of device slots), and one pipeline gains nothing from running two
generations at once. Jobs finish in the order they were submitted.

The event loop only ever touches this queue under a lock held for a few deque operations, never while a
job runs, and waits for results through `concurrent.futures.Future` (``asyncio.wrap_future``). It stops a job
through `stop`: a waiting job is dropped, a started one is signalled and stops at its next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from layerstream.errors import LayerstreamError
from layerstream.server.stopping import StopReason, StopSignal

logger = logging.getLogger(__name__)


class QueueFullError(LayerstreamError, RuntimeError):
    """The queue already holds its maximum of waiting jobs."""


class QueueClosedError(LayerstreamError, RuntimeError):
    """The queue takes no more jobs (the server is shutting down); waiting jobs fail with it too."""


class QueueTimeoutError(LayerstreamError, TimeoutError):
    """The job waited past its deadline and was never started."""


@dataclass(eq=False)
class Job:
    """One submitted unit of work; `future` holds its result or its exception."""

    work: Callable[[Job], Any]
    """Called on the worker thread with the job itself (for its queue time)."""
    timeout: float | None
    """Seconds from submission to the answer: waiting, generating and encoding (None: no limit)."""
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    future: Future = field(default_factory=Future)
    stop_signal: StopSignal = field(default_factory=StopSignal)
    """Set from the event loop to stop the job once started; the work checks it between steps."""

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted_at + self.timeout

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (negative once past), or None without a timeout."""
        deadline = self.deadline
        return None if deadline is None else deadline - time.monotonic()

    @property
    def queue_seconds(self) -> float:
        """Time waited before starting (so far, if not started)."""
        end = self.started_at if self.started_at is not None else time.monotonic()
        return end - self.submitted_at


class GenerationQueue:
    """Bounded FIFO with one worker thread. `max_waiting` counts jobs not yet started."""

    def __init__(self, max_waiting: int, *, thread_name: str = "layerstream-generate"):
        if max_waiting < 0:
            raise ValueError(f"max_waiting = {max_waiting!r} is not valid; expected an integer >= 0")
        self.max_waiting = max_waiting
        self._thread_name = thread_name
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.num_submitted = 0
        self.num_started = 0

    # state -----------------------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> bool:
        with self._cond:
            return self._running is not None

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    # lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (once)."""
        with self._cond:
            if self._thread is not None:
                return
            # daemon: a hung generation must not keep the process alive after the server has stopped
            self._thread = threading.Thread(target=self._run_worker, name=self._thread_name, daemon=True)
            self._thread.start()

    def close(self) -> int:
        """Take no more jobs and fail every waiting one with `QueueClosedError`; the running job goes on.

        Returns how many waiting jobs were failed. The worker exits once the running job is done.
        """
        with self._cond:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for job in dropped:
            _fail(job, QueueClosedError("the server is shutting down; the request was not started"))
        return len(dropped)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to exit (after `close`); True if it did."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # jobs ------------------------------------------------------------------------------------------------------
    def submit(self, work: Callable[[Job], Any], *, timeout: float | None = None) -> Job:
        """Queue `work` behind the others; raises `QueueFullError` or `QueueClosedError` instead of queueing."""
        job = Job(work=work, timeout=timeout)
        with self._cond:
            if self._closed:
                raise QueueClosedError("the server is shutting down and takes no new requests")
            # jobs that would wait behind a running one, this one included (a waiting job with nothing running is
            # about to start, so it does not count)
            num_behind = len(self._waiting) + (1 if self._running is not None else 0)
            if num_behind > self.max_waiting:
                raise QueueFullError(f"the queue is full ({self.max_waiting} waiting behind a running generation)")
            self._waiting.append(job)
            self.num_submitted += 1
            self._cond.notify()
        return job

    def stop(self, job: Job, reason: StopReason) -> bool:
        """Stop `job` for `reason`; True if it was still waiting (it is dropped and never starts).

        A waiting job fails at once: `QueueTimeoutError` for a timeout, `QueueClosedError` for a shutdown, and
        a cancelled future when its client is gone. A started job is asked to stop at its next denoising step
        (its future then fails with `GenerationStopped`); a finished one is left as it is.
        """
        if not self._remove_waiting(job):
            job.stop_signal.request(reason)  # started or done: the worker reads this between steps
            return False
        if reason is StopReason.TIMEOUT:
            _fail(job, _timeout_error(job))
        elif reason is StopReason.SHUTDOWN:
            _fail(job, QueueClosedError("the server is shutting down; the request was not started"))
        else:
            job.future.cancel()
        return True

    def stop_running(self, reason: StopReason) -> bool:
        """Ask the running job, if any, to stop at its next denoising step; True if one was running."""
        with self._cond:
            job = self._running
        if job is None:
            return False
        job.stop_signal.request(reason)
        return True

    def _remove_waiting(self, job: Job) -> bool:
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            return True

    # worker ----------------------------------------------------------------------------------------------------
    def _run_worker(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return  # closed and nothing left
                job = self._waiting.popleft()
                deadline = job.deadline
                if deadline is not None and time.monotonic() >= deadline:
                    expired = True  # the event loop has not noticed the deadline yet; the job must still not start
                else:
                    expired = False
                    if not job.future.set_running_or_notify_cancel():
                        continue  # cancelled while waiting
                    job.started_at = time.monotonic()
                    self._running = job
                    self.num_started += 1
            if expired:
                _fail(job, _timeout_error(job))
                continue
            try:
                result = job.work(job)
            except BaseException as e:  # reported to the waiting request; the worker lives on for the next job
                job.future.set_exception(e)
            else:
                job.future.set_result(result)
            finally:
                with self._cond:
                    self._running = None


def _timeout_error(job: Job) -> QueueTimeoutError:
    return QueueTimeoutError(f"waited {job.queue_seconds:.3f} s in the queue (timeout {job.timeout} s); not started")


def _fail(job: Job, error: BaseException) -> None:
    try:
        job.future.set_exception(error)
    except InvalidStateError:
        pass  # its waiter cancelled it first (the client went away): nobody is left to tell
