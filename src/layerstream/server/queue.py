"""A bounded FIFO of jobs, run by exactly one worker thread, which hands what it takes to a runner.
One thread, not a pool: the offload runtime refuses a second thread in a streamed model (the blocks share one
ring of device slots), and one pipeline gains nothing from two generations at once. A `TakePolicy` says what
the worker takes (one job, a `BatchPolicy` batch, or a wave: `waves.WavePolicy`); a `Runner` runs it and gives
back one outcome per job. The event loop touches the queue only under a lock held for a few deque operations,
and stops a job through `stop`: a waiting one is dropped, a started one stops at its next step."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from layerstream.errors import LayerstreamError
from layerstream.server.stopping import StopReason, StopSignal

logger = logging.getLogger(__name__)


class QueueFullError(LayerstreamError, RuntimeError):
    """The queue already holds its maximum of waiting jobs."""


class QueueClosedError(LayerstreamError, RuntimeError):
    """The queue takes no more jobs (the server is shutting down); waiting jobs fail with it too."""


class QueueTimeoutError(LayerstreamError, TimeoutError):
    """The job waited past its deadline and was never started."""


ServedT = TypeVar("ServedT")
ResultT = TypeVar("ResultT")


@dataclass(eq=False)
class Job(Generic[ServedT]):
    """One submitted unit of work; `future` holds its result or its exception."""

    served: ServedT  # what the runner runs (the server's `ServedRequest`)
    timeout: float | None  # seconds from submission to the answer (None: no limit)
    batch_key: Hashable | None = None  # jobs with equal keys may run as one batch; None: always alone
    cost: int = 0  # the job's share of a batch's `BatchPolicy.max_cost`
    observer: object = None  # the `StepObserver` of a job of the job API, or None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    future: Future = field(default_factory=Future)
    stop_signal: StopSignal = field(default_factory=StopSignal)  # read by the runner between steps

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted_at + self.timeout

    def seconds_left(self) -> float | None:
        deadline = self.deadline
        return None if deadline is None else deadline - time.monotonic()

    @property
    def queue_seconds(self) -> float:
        end = self.started_at if self.started_at is not None else time.monotonic()
        return end - self.submitted_at


Outcome = ResultT | BaseException  # a job's result, or the exception it fails with


class Runner(Protocol[ServedT, ResultT]):
    """Runs what the worker takes. Stops are read from each job's `stop_signal` between steps."""

    def run(self, groups: list[list[Job[ServedT]]]) -> Sequence[Outcome[ResultT]]:
        """Run `groups` (each one pipeline call, or one rank's share); one outcome per job, in order."""
        ...

    def after_run(self) -> None:
        """After the outcomes of a run are answered (a rank group rebuilds here, its clients already told)."""
        ...

    def idle(self) -> None:
        """Nothing ran for the policy's `idle_seconds` (a rank group checks on its ranks here)."""
        ...


@dataclass(frozen=True)
class Take:
    """The groups to run, unless the head should wait `wait_seconds` (> 0) longer for more to join."""

    groups: list[list[Job]]
    wait_seconds: float = 0.0


class TakePolicy(Protocol):
    """Which waiting jobs the worker takes next, and in which groups."""

    idle_seconds: float | None  # with nothing waiting this long, the worker calls `Runner.idle` (None: never)

    def take(self, waiting: Sequence[Job]) -> Take:
        """The groups headed by ``waiting[0]`` (never empty), oldest first; called under the queue's lock."""
        ...


@dataclass(frozen=True)
class TakeOne:
    """Every job alone, in order."""

    idle_seconds: float | None = None

    def take(self, waiting: Sequence[Job]) -> Take:
        return Take([[waiting[0]]])


@dataclass(frozen=True, kw_only=True)
class BatchPolicy:
    """The head takes along the waiting jobs with its `batch_key`, oldest first, up to `max_batch_size` of summed
    `cost` at most `max_cost` (the server's work cap). It waits for more until `wait_seconds` after its own
    submission, so a head that already waited under load never waits longer."""

    max_batch_size: int  # 1: every job runs alone
    wait_seconds: float
    max_cost: int
    idle_seconds: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size = {self.max_batch_size!r} is not valid; expected an integer >= 1")
        if not 0 <= self.wait_seconds < float("inf"):
            raise ValueError(f"wait_seconds = {self.wait_seconds!r} is not valid; expected seconds >= 0")
        if isinstance(self.max_cost, bool) or not isinstance(self.max_cost, int) or self.max_cost < 1:
            raise ValueError(f"max_cost = {self.max_cost!r} is not valid; expected an integer >= 1")

    def take(self, waiting: Sequence[Job]) -> Take:
        head = waiting[0]
        if self.max_batch_size == 1 or head.batch_key is None:
            return Take([[head]])
        batch, cost = [head], head.cost
        for job in waiting[1:]:
            if len(batch) == self.max_batch_size:
                break
            # a job that would take the batch past the cost cap waits for a later batch (it may head it)
            if job.batch_key == head.batch_key and cost + job.cost <= self.max_cost:
                batch.append(job)
                cost += job.cost
        full = len(batch) >= self.max_batch_size
        return Take([batch], 0.0 if full else head.submitted_at + self.wait_seconds - time.monotonic())


class GenerationQueue(Generic[ServedT, ResultT]):
    """Bounded FIFO of `max_waiting` jobs not yet started, with one worker thread running `policy`'s takes."""

    def __init__(
        self, max_waiting: int, *, runner: Runner[ServedT, ResultT], policy: TakePolicy | None = None,
        thread_name: str = "layerstream-generate",
    ):  # fmt: skip
        if max_waiting < 0:
            raise ValueError(f"max_waiting = {max_waiting!r} is not valid; expected an integer >= 0")
        self.max_waiting = max_waiting
        self.policy: TakePolicy = policy if policy is not None else TakeOne()
        self.runner = runner
        self._thread_name = thread_name
        self._waiting: deque[Job[ServedT]] = deque()
        self._running: list[Job[ServedT]] = []
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.num_submitted = 0
        self.num_started = 0

    @property
    def depth(self) -> int:  # waiting, the running not counted
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> bool:
        return self.num_running > 0

    @property
    def num_running(self) -> int:
        with self._cond:
            return len(self._running)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            # daemon: a hung generation must not keep the process alive after the server has stopped
            self._thread = threading.Thread(target=self._run_worker, name=self._thread_name, daemon=True)
            self._thread.start()

    def close(self) -> int:
        """Take no more jobs and fail every waiting one (how many) with `QueueClosedError`; the running go on."""
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

    def submit(
        self, served: ServedT, *, timeout: float | None = None, batch_key: Hashable | None = None, cost: int = 0,
        observer: object = None,
    ) -> Job[ServedT]:
        """Queue `served` behind the others; raises `QueueFullError` or `QueueClosedError` instead of queueing."""
        job = Job(served=served, timeout=timeout, batch_key=batch_key, cost=cost, observer=observer)
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
        """Stop `job`; True if it was waiting (it fails at once), else it is asked to stop at its next step."""
        with self._cond:
            waiting = job in self._waiting
            if waiting:
                self._waiting.remove(job)
        if not waiting:
            job.stop_signal.request(reason)  # started or done: the runner reads this between steps
            return False
        if reason is StopReason.TIMEOUT:
            fail_job(job, timeout_error(job))
        elif reason is StopReason.SHUTDOWN:
            fail_job(job, QueueClosedError("the server is shutting down; the request was not started"))
        else:
            job.future.cancel()
        return True

    def stop_running(self, reason: StopReason) -> bool:
        """Ask every running job, if any, to stop at its next denoising step; True if one was running."""
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

    def _run_worker(self) -> None:
        while True:
            taken = self._take_next()
            if taken is None:
                return  # closed and nothing left
            groups, expired = taken
            for job in expired:
                fail_job(job, timeout_error(job))
            if not groups:
                if not expired:
                    self._bookkeeping(self.runner.idle)
                continue  # every job taken had expired or been cancelled, or there was none
            jobs = [job for group in groups for job in group]
            try:
                outcomes = list(self.runner.run(groups))
                if len(outcomes) != len(jobs):
                    raise RuntimeError(f"the runner returned {len(outcomes)} outcomes for {len(jobs)} jobs")
            except BaseException as e:  # the whole run failed: each of its jobs is told; the worker lives on
                outcomes = [e] * len(jobs)
            finally:
                with self._cond:
                    self._running = []
            for job, outcome in zip(jobs, outcomes):
                if isinstance(outcome, BaseException):
                    fail_job(job, outcome)
                else:
                    job.future.set_result(outcome)
            self._bookkeeping(self.runner.after_run)

    def _bookkeeping(self, step) -> None:
        """The runner's `after_run` or `idle`: nobody waits on it, so an error is logged and the worker goes on."""
        try:
            step()
        except Exception:  # noqa: BLE001 - logged with its traceback; the worker must outlive it
            logger.exception("the runner's %s failed; the worker goes on", step.__name__)

    def _take_next(self) -> tuple[list[list[Job]], list[Job]] | None:
        """(the groups to run now, started; the taken jobs whose deadline passed), ([], []) after `idle_seconds`
        with nothing waiting, or None once closed and empty."""
        idle_seconds = self.policy.idle_seconds
        with self._cond:
            while True:
                while not self._waiting and not self._closed:
                    if not self._cond.wait(idle_seconds) and not self._waiting and not self._closed:
                        return [], []  # idle_seconds passed with nothing to run
                if not self._waiting:
                    return None
                take = self.policy.take(list(self._waiting))
                if take.wait_seconds <= 0:
                    break
                # woken by a submit (the groups may now be full) or at the end of the head's wait; a stop that
                # removes the head is seen on the next pass
                self._cond.wait(take.wait_seconds)
            started_groups, expired = [], []
            now = time.monotonic()
            for group in take.groups:
                started = []
                for job in group:
                    self._waiting.remove(job)
                    if job.deadline is not None and now >= job.deadline:
                        expired.append(job)  # the event loop has not noticed the deadline yet; it must still not start
                    elif job.future.set_running_or_notify_cancel():  # False: cancelled while waiting
                        job.started_at = now
                        started.append(job)
                if started:
                    started_groups.append(started)
            self._running = [job for group in started_groups for job in group]
            self.num_started += len(self._running)
            return started_groups, expired


def timeout_error(job: Job) -> QueueTimeoutError:
    return QueueTimeoutError(f"waited {job.queue_seconds:.3f} s in the queue (timeout {job.timeout} s); not started")


def fail_job(job: Job, error: BaseException) -> None:
    try:
        job.future.set_exception(error)
    except InvalidStateError:
        pass  # its waiter cancelled it first (the client went away): nobody is left to tell
