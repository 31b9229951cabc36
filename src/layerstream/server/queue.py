"""A bounded FIFO of jobs, run by exactly one worker thread: one at a time, or several together in a batch.

One thread, not a pool: the offload runtime refuses a second thread entering a streamed model while one
runs it (the blocks share one ring of device slots), and one pipeline gains nothing from running two
generations at once. Jobs finish in the order they were submitted.

With a `BatchPolicy`, the job at the head of the queue takes along the waiting jobs with its `batch_key`
(oldest first, up to `max_batch_size` jobs whose `cost` sums to at most `max_cost`), and they run as one
batch. The head waits for its batch to fill at most until `wait_seconds` after it was submitted, so a server
under load, whose head has already waited, never adds to its wait. Jobs that cannot join keep their order:
the oldest of them is the next head.

The event loop only ever touches this queue under a lock held for a few deque operations, never while a
job runs, and waits for results through `concurrent.futures.Future` (``asyncio.wrap_future``). It stops a job
through `stop`: a waiting job is dropped, a started one is signalled and stops at its next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from layerstream.errors import LayerstreamError
from layerstream.server.stopping import StopReason, StopSignal

logger = logging.getLogger(__name__)


class QueueFullError(LayerstreamError, RuntimeError):
    """The queue already holds its maximum of waiting jobs."""


class QueueClosedError(LayerstreamError, RuntimeError):
    """The queue takes no more jobs (the server is shutting down); waiting jobs fail with it too."""


class QueueTimeoutError(LayerstreamError, TimeoutError):
    """The job waited past its deadline and was never started."""


RequestT = TypeVar("RequestT")


@dataclass(frozen=True, kw_only=True)
class BatchPolicy:
    """Which waiting jobs run together, and how long the head of the queue waits for others to join."""

    max_batch_size: int
    """Most jobs in one batch (1: every job runs alone)."""
    wait_seconds: float
    """Longest the head waits, from its submission, for its batch to fill."""
    max_cost: int
    """Most summed `Job.cost` of one batch: a batch that would exceed it is split (the server's work cap)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size = {self.max_batch_size!r} is not valid; expected an integer >= 1")
        if not 0 <= self.wait_seconds < float("inf"):
            raise ValueError(f"wait_seconds = {self.wait_seconds!r} is not valid; expected seconds >= 0")
        if isinstance(self.max_cost, bool) or not isinstance(self.max_cost, int) or self.max_cost < 1:
            raise ValueError(f"max_cost = {self.max_cost!r} is not valid; expected an integer >= 1")


@dataclass(eq=False)
class Job(Generic[RequestT]):
    """One submitted unit of work; `future` holds its result or its exception."""

    work: Callable[[Job], Any]
    """Called on the worker thread with the job itself (for its queue time) when the job runs alone."""
    timeout: float | None
    """Seconds from submission to the answer: waiting, generating and encoding (None: no limit)."""
    request: RequestT | None = None
    """What the work runs, for the batch runner, which runs several jobs' requests in one call."""
    batch_key: Hashable | None = None
    """Jobs with equal keys may run as one batch; None: this job always runs alone."""
    cost: int = 0
    """The job's share of a batch's `BatchPolicy.max_cost`."""
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


BatchOutcome = Any
"""What the batch runner gives back for each job of a batch: its result, or the exception it fails with."""
BatchRunner = Callable[[Sequence[Job]], Sequence[BatchOutcome]]
"""Runs a batch of started jobs as one; returns one outcome per job, in order, or raises to fail them all."""


class GenerationQueue:
    """Bounded FIFO with one worker thread. `max_waiting` counts jobs not yet started.

    With `batching` (and `run_batch`, which runs a batch of two or more jobs), compatible jobs run together.
    """

    def __init__(
        self,
        max_waiting: int,
        *,
        thread_name: str = "layerstream-generate",
        batching: BatchPolicy | None = None,
        run_batch: BatchRunner | None = None,
    ):
        if max_waiting < 0:
            raise ValueError(f"max_waiting = {max_waiting!r} is not valid; expected an integer >= 0")
        if batching is not None and batching.max_batch_size > 1 and run_batch is None:
            raise ValueError("batching with max_batch_size > 1 needs run_batch, the function that runs a batch")
        self.max_waiting = max_waiting
        self.batching = batching
        self._run_batch = run_batch
        self._thread_name = thread_name
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
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
            return bool(self._running)

    @property
    def num_running(self) -> int:
        """Jobs of the running batch (1 for a job running alone, 0 when idle)."""
        with self._cond:
            return len(self._running)

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
            fail_job(job, QueueClosedError("the server is shutting down; the request was not started"))
        return len(dropped)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to exit (after `close`); True if it did."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # jobs ------------------------------------------------------------------------------------------------------
    def submit(
        self,
        work: Callable[[Job], Any],
        *,
        timeout: float | None = None,
        request: Any = None,
        batch_key: Hashable | None = None,
        cost: int = 0,
    ) -> Job:
        """Queue `work` behind the others; raises `QueueFullError` or `QueueClosedError` instead of queueing.

        With batching on, `request` is what the batch runner reads, and jobs with the same `batch_key` may run
        together (`cost` counted against the policy's `max_cost`).
        """
        job = Job(work=work, timeout=timeout, request=request, batch_key=batch_key, cost=cost)
        with self._cond:
            if self._closed:
                raise QueueClosedError("the server is shutting down and takes no new requests")
            # jobs that would wait behind a running one, this one included (a waiting job with nothing running is
            # about to start, so it does not count)
            num_behind = len(self._waiting) + (1 if self._running else 0)
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
            fail_job(job, timeout_error(job))
        elif reason is StopReason.SHUTDOWN:
            fail_job(job, QueueClosedError("the server is shutting down; the request was not started"))
        else:
            job.future.cancel()
        return True

    def stop_running(self, reason: StopReason) -> bool:
        """Ask the running job (every job of the running batch), if any, to stop at its next denoising step;
        True if one was running."""
        with self._cond:
            jobs = list(self._running)
        for job in jobs:
            job.stop_signal.request(reason)
        return bool(jobs)

    def position(self, job: Job) -> int | None:
        """Where `job` waits: 1 runs next; None once it has started (or left the queue)."""
        with self._cond:
            try:
                return self._waiting.index(job) + 1
            except ValueError:
                return None

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
            taken = self._take_next()
            if taken is None:
                return  # closed and nothing left
            jobs, expired = taken
            for job in expired:
                fail_job(job, timeout_error(job))
            if not jobs:
                continue  # every job taken had expired or been cancelled
            try:
                if len(jobs) == 1:
                    _run_alone(jobs[0])
                else:
                    self._run_together(jobs)
            finally:
                with self._cond:
                    self._running = []

    def _take_next(self) -> tuple[list[Job], list[Job]] | None:
        """(the jobs to run now, started; the taken jobs whose deadline passed while they waited), or None once
        closed and empty. Blocks until a job waits and, with batching, until its batch is full or its wait is over."""
        with self._cond:
            while True:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return None
                head = self._waiting[0]
                batch = self._batch_for(head)
                wait_left = self._fill_wait_left(head, len(batch))
                if wait_left <= 0:
                    break
                # woken by a submit (the batch may now be full) or at the end of the head's wait; a stop that
                # removes the head is seen on the next pass
                self._cond.wait(wait_left)
            for job in batch:
                self._waiting.remove(job)
            started, expired = [], []
            now = time.monotonic()
            for job in batch:
                deadline = job.deadline
                if deadline is not None and now >= deadline:
                    expired.append(job)  # the event loop has not noticed the deadline yet; it must still not start
                elif job.future.set_running_or_notify_cancel():  # False: cancelled while waiting
                    job.started_at = now
                    started.append(job)
            self._running = started
            self.num_started += len(started)
            return started, expired

    def _batch_for(self, head: Job) -> list[Job]:
        """`head` and the waiting jobs that may run with it, oldest first, within the policy's size and cost."""
        policy = self.batching
        batch = [head]
        if policy is None or policy.max_batch_size == 1 or head.batch_key is None:
            return batch
        cost = head.cost
        for job in self._waiting:
            if len(batch) == policy.max_batch_size:
                break
            # a job that would take the batch past the cost cap waits for a later batch (it may head it)
            if job is not head and job.batch_key == head.batch_key and cost + job.cost <= policy.max_cost:
                batch.append(job)
                cost += job.cost
        return batch

    def _fill_wait_left(self, head: Job, batch_size: int) -> float:
        """Seconds the head may still wait for more jobs to join its batch (<= 0: start now)."""
        policy = self.batching
        if policy is None or head.batch_key is None or batch_size >= policy.max_batch_size:
            return 0.0
        return head.submitted_at + policy.wait_seconds - time.monotonic()

    def _run_together(self, jobs: list[Job]) -> None:
        assert self._run_batch is not None  # checked in __init__ for any policy that can make a batch
        try:
            outcomes = list(self._run_batch(jobs))
            if len(outcomes) != len(jobs):
                raise RuntimeError(f"the batch runner returned {len(outcomes)} outcomes for {len(jobs)} jobs")
        except BaseException as e:  # the whole batch failed: each of its requests is told; the worker lives on
            for job in jobs:
                job.future.set_exception(e)
            return
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)


def _run_alone(job: Job) -> None:
    try:
        result = job.work(job)
    except BaseException as e:  # reported to the waiting request; the worker lives on for the next job
        job.future.set_exception(e)
    else:
        job.future.set_result(result)


def timeout_error(job: Job) -> QueueTimeoutError:
    return QueueTimeoutError(f"waited {job.queue_seconds:.3f} s in the queue (timeout {job.timeout} s); not started")


def fail_job(job: Job, error: BaseException) -> None:
    try:
        job.future.set_exception(error)
    except InvalidStateError:
        pass  # its waiter cancelled it first (the client went away): nobody is left to tell
