"""`GenerationQueue` on its own: FIFO on one thread, bounded, timeouts that never start work, drain."""

from __future__ import annotations

import threading
import time

import pytest

from layerstream.server.queue import GenerationQueue, QueueClosedError, QueueFullError, QueueTimeoutError
from layerstream.server.stopping import GenerationStopped, StopReason


def _blocker():
    """A job that runs until released, and an event set once it has started."""
    started, release = threading.Event(), threading.Event()

    def work(job):
        started.set()
        assert release.wait(10)
        return "blocker"

    return work, started, release


@pytest.fixture
def queue():
    q = GenerationQueue(max_waiting=3)
    q.start()
    yield q
    q.close()
    assert q.join(10)


def test_jobs_run_in_order_on_one_thread(queue):
    threads, order = set(), []

    def work(i):
        def run(job):
            threads.add(threading.get_ident())
            order.append(i)
            return i

        return run

    block, started, release = _blocker()
    queue.submit(block)
    assert started.wait(10)
    jobs = [queue.submit(work(i)) for i in range(3)]
    release.set()
    assert [j.future.result(10) for j in jobs] == [0, 1, 2]
    assert order == [0, 1, 2] and len(threads) == 1 and threading.get_ident() not in threads


def test_full_queue_refuses(queue):
    block, started, release = _blocker()
    queue.submit(block)
    assert started.wait(10)
    for _ in range(3):
        queue.submit(lambda job: None)
    with pytest.raises(QueueFullError):
        queue.submit(lambda job: None)
    assert queue.depth == 3 and queue.running
    release.set()


def test_expired_job_never_starts(queue):
    block, started, release = _blocker()
    queue.submit(block)
    assert started.wait(10)
    ran = threading.Event()
    late = queue.submit(lambda job: ran.set(), timeout=0.05)
    assert queue.stop(late, StopReason.TIMEOUT)
    with pytest.raises(QueueTimeoutError):
        late.future.result(1)
    # the worker also refuses a job whose deadline passed before it got to it, timer or not
    stale = queue.submit(lambda job: ran.set(), timeout=0.01)
    time.sleep(0.05)
    release.set()
    with pytest.raises(QueueTimeoutError):
        stale.future.result(10)
    assert not ran.is_set() and queue.num_started == 1


def test_a_failing_job_does_not_stop_the_worker(queue):
    def boom(job):
        raise RuntimeError("boom")

    failed = queue.submit(boom)
    with pytest.raises(RuntimeError, match="boom"):
        failed.future.result(10)
    assert queue.submit(lambda job: 42).future.result(10) == 42


def test_close_answers_waiting_jobs_and_finishes_the_running_one():
    queue = GenerationQueue(max_waiting=2)
    queue.start()
    block, started, release = _blocker()
    running = queue.submit(block)
    assert started.wait(10)
    waiting = queue.submit(lambda job: "never")
    assert queue.close() == 1
    with pytest.raises(QueueClosedError):
        waiting.future.result(1)
    with pytest.raises(QueueClosedError):
        queue.submit(lambda job: None)
    release.set()
    assert running.future.result(10) == "blocker"
    assert queue.join(10)


def test_cancelled_job_is_dropped(queue):
    block, started, release = _blocker()
    queue.submit(block)
    assert started.wait(10)
    job = queue.submit(lambda job: "never")
    assert queue.stop(job, StopReason.CLIENT_GONE) and job.future.cancelled() and queue.depth == 0
    assert not queue.stop(job, StopReason.TIMEOUT)  # already gone: nothing to do, no error
    release.set()


def test_a_started_job_is_signalled_and_stops_where_it_checks(queue):
    checked = threading.Event()

    def steps(job):
        for _ in range(1000):
            job.stop_signal.raise_if_requested("between steps")
            checked.set()
            time.sleep(0.01)
        return "ran to the end"

    job = queue.submit(steps)
    assert checked.wait(10)
    assert not queue.stop(job, StopReason.TIMEOUT)  # started: signalled, not dropped
    queue.stop(job, StopReason.CLIENT_GONE)  # a second reason does not replace the first
    with pytest.raises(GenerationStopped) as info:
        job.future.result(10)
    assert info.value.reason is StopReason.TIMEOUT
    assert queue.submit(lambda job: 42).future.result(10) == 42  # the worker lives on


def test_stop_running_signals_only_the_running_job(queue):
    assert not queue.stop_running(StopReason.SHUTDOWN)  # nothing running: nothing to do
    block, started, release = _blocker()
    running = queue.submit(block)
    assert started.wait(10)
    waiting = queue.submit(lambda job: "next")
    assert queue.stop_running(StopReason.SHUTDOWN)
    assert running.stop_signal.reason is StopReason.SHUTDOWN and waiting.stop_signal.reason is None
    release.set()
    assert running.future.result(10) == "blocker" and waiting.future.result(10) == "next"
