"""`GenerationQueue` on its own: FIFO on one thread, bounded, timeouts that never start work, drain."""

from __future__ import annotations

import threading
import time

import pytest

from layerstream.server.queue import BatchPolicy, GenerationQueue, QueueClosedError, QueueFullError, QueueTimeoutError
from layerstream.server.stopping import GenerationStopped, StopReason

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


class RunEach:
    """A runner whose jobs are functions: each group's jobs called one by one with the job itself (or, with
    `run_batch`, a group of several handed to it whole)."""

    def __init__(self, run_batch=None):
        self.run_batch = run_batch

    def run(self, groups):
        (group,) = groups
        if len(group) > 1:
            return self.run_batch(group)
        (job,) = group
        try:
            return [job.served(job)]
        except BaseException as e:  # reported to the waiting request; the worker lives on for the next job
            return [e]

    def after_run(self):
        pass

    def idle(self):
        pass


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
    q = GenerationQueue(max_waiting=3, runner=RunEach())
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
    queue = GenerationQueue(max_waiting=2, runner=RunEach())
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


# batching --------------------------------------------------------------------------------------------------------


def _batching_queue(max_batch_size: int, wait_seconds: float = 0.0, max_cost: int = 100):
    """A batching queue whose batch runner records each batch's job names and answers each job its name."""
    batches: list[list[str]] = []

    def run_batch(jobs):
        batches.append([job.served(job) for job in jobs])
        return [job.served(job) for job in jobs]

    policy = BatchPolicy(max_batch_size=max_batch_size, wait_seconds=wait_seconds, max_cost=max_cost)
    q = GenerationQueue(max_waiting=8, runner=RunEach(run_batch), policy=policy)
    q.start()
    return q, batches


def _alone(name: str):
    return lambda job: name


def test_compatible_jobs_run_together_and_the_others_keep_their_order():
    queue, batches = _batching_queue(max_batch_size=3, max_cost=10)
    block, started, release = _blocker()
    queue.submit(block)  # no batch key: runs alone, and holds the queue while the others arrive
    assert started.wait(10)
    jobs = [
        queue.submit(_alone(name), batch_key=key, cost=cost)
        for name, key, cost in [("a", 32, 1), ("b", 64, 1), ("c", 32, 1), ("d", 64, 1), ("e", 32, 9), ("f", 32, 1)]
    ]
    release.set()
    assert [job.future.result(10) for job in jobs] == ["a", "b", "c", "d", "e", "f"]
    # e would take a's batch past the cost cap: it waits and heads a later batch; f joins the first one instead
    assert batches == [["a", "c", "f"], ["b", "d"]]  # e ran alone (its work, not run_batch)
    queue.close()
    assert queue.join(10)


def test_the_head_waits_for_its_batch_at_most_the_batch_wait():
    # a batch wait far longer than the test: the head starts when its batch is full, not when the wait ends
    queue, batches = _batching_queue(max_batch_size=2, wait_seconds=600)
    first = queue.submit(_alone("a"), batch_key=1)
    time.sleep(0.1)
    assert not first.future.done()  # the head waits for a partner
    second = queue.submit(_alone("b"), batch_key=1)
    assert second.future.result(10) == "b" and first.future.result(10) == "a"
    assert batches == [["a", "b"]]
    queue.close()
    assert queue.join(10)
    # alone, the head waits out the batch wait (at least it) and then runs by itself
    queue, batches = _batching_queue(max_batch_size=2, wait_seconds=0.4)
    lone = queue.submit(_alone("c"), batch_key=1)
    assert lone.future.result(10) == "c" and lone.queue_seconds >= 0.4 and batches == []  # its work, not run_batch
    queue.close()
    assert queue.join(10)


def test_a_job_failed_by_the_batch_runner_does_not_fail_the_others_and_a_raising_batch_fails_all():
    calls = []

    def run_batch(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            return [RuntimeError("only this one"), "ok"]
        raise RuntimeError("the whole batch")

    queue = GenerationQueue(max_waiting=8, policy=BatchPolicy(max_batch_size=2, wait_seconds=5.0, max_cost=10),
                            runner=RunEach(run_batch))  # fmt: skip
    queue.start()
    try:
        pairs = []
        for _ in range(2):
            pair = [queue.submit(_alone("alone"), batch_key="k") for i in range(2)]
            pairs.append(pair)
            pair[1].future.exception(10)  # the batch of two starts at once: no need to wait out the 5 s
        with pytest.raises(RuntimeError, match="only this one"):
            pairs[0][0].future.result(1)
        assert pairs[0][1].future.result(1) == "ok"
        for job in pairs[1]:
            with pytest.raises(RuntimeError, match="the whole batch"):
                job.future.result(1)
        assert queue.submit(lambda job: 42).future.result(10) == 42  # the worker lives on
    finally:
        queue.close()
        assert queue.join(10)


def test_stop_running_signals_every_job_of_the_running_batch():
    release = threading.Event()
    running = threading.Event()

    def run_batch(jobs):
        running.set()
        assert release.wait(10)
        return [job.stop_signal.reason for job in jobs]

    queue = GenerationQueue(max_waiting=8, policy=BatchPolicy(max_batch_size=2, wait_seconds=5.0, max_cost=10),
                            runner=RunEach(run_batch))  # fmt: skip
    queue.start()
    jobs = [queue.submit(_alone("alone"), batch_key="k") for _ in range(2)]
    assert running.wait(10) and queue.num_running == 2
    assert queue.stop_running(StopReason.SHUTDOWN)
    release.set()
    assert [job.future.result(10) for job in jobs] == [StopReason.SHUTDOWN] * 2
    queue.close()
    assert queue.join(10)


class FailingBookkeeping(RunEach):
    """`after_run` raises after every run and `idle` whenever the queue idles: the worker must go on."""

    def __init__(self):
        super().__init__()
        self.calls = {"after_run": 0, "idle": 0}

    def after_run(self):
        self.calls["after_run"] += 1
        raise RuntimeError("after_run broke")

    def idle(self):
        self.calls["idle"] += 1
        raise RuntimeError("idle broke")


def test_the_worker_survives_its_runners_bookkeeping(caplog):
    runner = FailingBookkeeping()
    queue = GenerationQueue(max_waiting=3, runner=runner, policy=BatchPolicy(max_batch_size=1, wait_seconds=0, max_cost=1, idle_seconds=0.01))
    queue.start()
    try:
        for name in ("a", "b", "c"):
            assert queue.submit(_alone(name)).future.result(10) == name  # each after an after_run that raised
        deadline = time.monotonic() + 10  # catches a hang only
        while runner.calls["idle"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert queue.submit(_alone("d")).future.result(10) == "d"  # and after idles that raised
    finally:
        queue.close()
        assert queue.join(10)
    assert runner.calls["after_run"] == 4
    assert "the runner's after_run failed" in caplog.text and "the runner's idle failed" in caplog.text
