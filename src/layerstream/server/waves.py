"""Rank 0 of a multi-rank server: waves of requests, one share per rank, and what the HTTP layer asks of them.

`WaveQueue` is the server's FIFO with another take: the head of the queue and the waiting requests that can
run beside it, up to one per rank (or one batch per rank with --max-batch-size), become a wave. Requests of a
wave run the same forwards on every rank (allgather gathers each block once per forward on every rank, so
every rank must run the same number of them): alone, they share their size, frames, steps, guidance,
negative prompt, output count and whether they carry an image; batched, their batch shape. A rank left without
a request runs a placeholder, a copy of another rank's work whose outputs are dropped.

`WaveService` is `GenerationService` with that queue: its worker thread broadcasts each wave, runs rank 0's
share, gathers every rank's outcome and answers. A wave that raised on any rank answers 500 to each of its
requests and is followed by a rebuild of the runtime on every rank. A rank that is gone or silent past the
collective timeout answers 503 and stops the server, which then exits non-zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from layerstream.errors import LayerstreamError
from layerstream.request import GenerationError
from layerstream.server.errors import ApiError
from layerstream.server.metrics import JobOutcome, render_families
from layerstream.server.queue import BatchOutcome, GenerationQueue, Job, fail_job, timeout_error
from layerstream.server.ranks import (
    ControlChannel,
    RankGroupError,
    RankOutcome,
    RankRuntime,
    RankWork,
    WaveKind,
    WaveMessage,
    WaveStop,
)
from layerstream.server.service import GenerationOutput, GenerationService, ServedRequest, request_usage
from layerstream.server.settings import ServeSettings
from layerstream.server.stopping import GenerationStopped, StopReason

logger = logging.getLogger(__name__)


class WaveFailedError(LayerstreamError, RuntimeError):
    """A wave's generation raised on some rank; every request of the wave is answered 500 with it."""


def wave_key(served: ServedRequest) -> Hashable:
    """What requests run alone must share to run side by side in one wave: the same forwards on every rank
    (their batch shape, output count and whether they carry an image; images may differ)."""
    request = served.request
    return replace(request.batch_shape(), image=None), request.n, request.image is not None


@dataclass(frozen=True, kw_only=True)
class WavePolicy:
    num_ranks: int
    max_batch_size: int
    """Requests of one rank's batch (1: each rank runs one request alone)."""
    wait_seconds: float
    """Longest the head waits, from its submission, for its wave to fill."""
    max_cost: int
    """Most summed `Job.cost` of one rank's batch."""
    idle_seconds: float
    """With nothing to run for this long, the worker checks on the ranks (`on_idle`)."""


class WaveQueue(GenerationQueue):
    """The bounded FIFO, taken a wave at a time: groups of jobs, one group per rank."""

    def __init__(
        self,
        max_waiting: int,
        *,
        policy: WavePolicy,
        run_wave: Callable[[list[list[Job]]], list[BatchOutcome]],
        after_wave: Callable[[], None],
        on_idle: Callable[[], None],
    ):
        super().__init__(max_waiting, thread_name="layerstream-waves")
        self.policy = policy
        self._run_wave = run_wave
        self._after_wave = after_wave
        self._on_idle = on_idle

    def _run_worker(self) -> None:
        while True:
            taken = self._take_wave()
            if taken is None:
                return  # closed and nothing left
            groups, expired = taken
            for job in expired:
                fail_job(job, timeout_error(job))
            if not groups:
                if not expired:
                    self._on_idle()
                continue
            jobs = [job for group in groups for job in group]
            try:
                outcomes = self._run_wave(groups)
            except BaseException as e:  # the whole wave failed: each of its requests is told
                outcomes = [e] * len(jobs)
            finally:
                with self._cond:
                    self._running = []
            for job, outcome in zip(jobs, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    fail_job(job, outcome)
                else:
                    job.future.set_result(outcome)
            self._after_wave()

    def _take_wave(self) -> tuple[list[list[Job]], list[Job]] | None:
        """(the groups to run, started; taken jobs whose deadline passed), ([], []) after `idle_seconds` with
        nothing to run, or None once closed and empty."""
        policy = self.policy
        with self._cond:
            while True:
                while not self._waiting and not self._closed:
                    if not self._cond.wait(policy.idle_seconds) and not self._waiting and not self._closed:
                        return [], []
                if not self._waiting:
                    return None
                head = self._waiting[0]
                groups, capacity = self._wave_for(head)
                wait_left = head.submitted_at + policy.wait_seconds - time.monotonic()
                if sum(map(len, groups)) >= capacity or wait_left <= 0:
                    break
                self._cond.wait(wait_left)  # woken by a submit, or at the end of the head's wait
            started_groups, expired = [], []
            now = time.monotonic()
            for group in groups:
                started = []
                for job in group:
                    self._waiting.remove(job)
                    if job.deadline is not None and now >= job.deadline:
                        expired.append(job)
                    elif job.future.set_running_or_notify_cancel():  # False: cancelled while waiting
                        job.started_at = now
                        started.append(job)
                if started:
                    started_groups.append(started)
            self._running = [job for group in started_groups for job in group]
            self.num_started += len(self._running)
            return started_groups, expired

    def _wave_for(self, head: Job) -> tuple[list[list[Job]], int]:
        """The groups of a wave headed by `head` (oldest first, spread over the ranks), and the most jobs it
        could hold."""
        policy = self.policy
        batching = policy.max_batch_size > 1 and head.batch_key is not None
        per_rank = policy.max_batch_size if batching else 1
        key = head.batch_key if batching else wave_key(head.request)
        groups, costs = [[head]], [head.cost]
        for job in self._waiting:
            if job is head:
                continue
            if (job.batch_key if batching else wave_key(job.request)) != key:
                continue
            if len(groups) < policy.num_ranks:  # spread first: ranks run side by side
                groups.append([job])
                costs.append(job.cost)
                continue
            room = [i for i, g in enumerate(groups) if len(g) < per_rank and costs[i] + job.cost <= policy.max_cost]
            if not room:
                if all(len(g) >= per_rank for g in groups):
                    break
                continue
            smallest = min(room, key=lambda i: len(groups[i]))
            groups[smallest].append(job)
            costs[smallest] += job.cost
        return groups, policy.num_ranks * per_rank


class WaveService(GenerationService):
    """`GenerationService` for rank 0 of several: requests run in waves across the ranks."""

    def __init__(self, runtime: RankRuntime, channel: ControlChannel, settings: ServeSettings, *, idle_seconds: float):
        super().__init__(runtime.omni, settings)
        self.runtime = runtime
        self.channel = channel
        setup = runtime.setup
        self._batching = settings.max_batch_size > 1
        self.queue = WaveQueue(
            settings.max_queue,
            policy=WavePolicy(
                num_ranks=setup.world_size,
                max_batch_size=settings.max_batch_size,
                wait_seconds=settings.batch_wait_ms / 1000,
                max_cost=self.limits.max_work,
                idle_seconds=idle_seconds,
            ),
            run_wave=self._run_wave,
            after_wave=self._after_wave,
            on_idle=self._ping,
        )
        self._lock = threading.Lock()
        self._wave_id = 0
        self._needs_rebuild = False
        self._rank_host_bytes: list[int | None] = [None] * setup.world_size
        self.num_waves = 0
        self.num_idle_rank_waves = 0
        self.num_placeholder_steps = 0
        self.fatal_error: RankGroupError | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        """Set by the runner: stop serving (the process then exits non-zero)."""
        self._exchange(WaveMessage(WaveKind.PING), lambda: None)  # every rank's host bytes, for /health

    # waves -----------------------------------------------------------------------------------------------------
    def _run_wave(self, groups: list[list[Job]]) -> list[BatchOutcome]:
        """Run on the worker thread: one wave, every rank its group (or a placeholder); one outcome per job."""
        if self.fatal_error is not None:
            return [self._unavailable()] * sum(map(len, groups))
        world_size = self.runtime.setup.world_size
        works = [
            RankWork(
                tuple(j.request.request for j in g), batch_call=self._batching and g[0].batch_key is not None,
                encodings=tuple(j.request.encoding for j in g),
            )
            for g in groups
        ]  # fmt: skip
        num_idle = world_size - len(works)
        works += [works[0].as_placeholder()] * num_idle
        self._wave_id += 1
        message = WaveMessage(WaveKind.RUN, self._wave_id, tuple(works))
        jobs = [job for group in groups for job in group]
        started = time.perf_counter()
        try:
            self.channel.broadcast(message)
            stop = WaveStop(self.runtime.setup.store, self._wave_id, decide=lambda: _stop_reason(jobs))
            outcomes = self.channel.gather(self.runtime.run(message, stop))
        except RankGroupError as e:
            self._lose_group(e)
            return [self._unavailable()] * len(jobs)
        finally:
            self._offload_stats = self.runtime.omni.stats()
        assert outcomes is not None  # rank 0 gathers
        seconds = time.perf_counter() - started
        with self._lock:
            self.num_waves += 1
            self.num_idle_rank_waves += num_idle
            self.num_placeholder_steps += sum(o.num_placeholder_steps for o in outcomes)
            self._rank_host_bytes = [o.host_bytes for o in outcomes]
        return self._answers(groups, outcomes, seconds)

    def _answers(self, groups: list[list[Job]], outcomes: list[RankOutcome], seconds: float) -> list[BatchOutcome]:
        failed = [o for o in outcomes if o.error is not None]
        stopped = next((o.stopped for o in outcomes if o.stopped is not None), None)
        failure: BaseException | None = None
        if failed and all(o.refused for o in failed):
            # the pipeline refused the arguments before any forward, alike on every rank: answered 400
            failure = GenerationError(failed[0].error)
        elif failed:
            failure = WaveFailedError("; ".join(f"rank {o.rank}: {o.error}" for o in failed))
            # rank-local runtimes are clean after an exception, as in one process; allgather's transfers are not
            self._needs_rebuild = self.runtime.shares_weights
        answers: list[BatchOutcome] = []
        for group, outcome in zip(groups, outcomes):
            num_group_outputs = sum(job.request.request.n for job in group)  # what its rank made in the wave
            for index, job in enumerate(group):
                # a request asked to stop is answered so, whatever the wave did: its outputs are dropped
                asked = job.stop_signal.reason or (stopped if failure is None else None)
                if asked is not None:
                    answer = GenerationStopped(asked, f"generation stopped ({asked}) during its wave")
                    job_outcome = JobOutcome.STOPPED
                elif failure is not None:
                    answer = failure
                    job_outcome = JobOutcome.ERROR
                else:
                    answer = self._output(job, outcome, index, len(group))
                    job_outcome = JobOutcome.OK
                answers.append(answer)
                self.metrics.observe_job(
                    queue_seconds=job.queue_seconds,
                    seconds=seconds * job.request.request.n / num_group_outputs,  # its share of its rank's call
                    num_outputs=job.request.request.n,
                    outcome=job_outcome,
                )
            self.metrics.observe_batch(len(group))
        return answers

    def _output(self, job: Job, outcome: RankOutcome, index: int, group_size: int) -> GenerationOutput:
        served: ServedRequest = job.request
        result = outcome.results[index]
        usage = request_usage(
            self.limits, served, result.runs, result.frames_shape, job.queue_seconds, batch_size=group_size
        )
        if self._batching and job.batch_key is not None:  # a batch call: this request's share of its bytes, by outputs
            num_outputs = sum(len(r.files) for r in outcome.results)
            share = result.runs[0].bytes_transferred * len(result.files) // num_outputs
            usage = usage.model_copy(update={"bytes_streamed": share})
        self.metrics.observe_request_bytes(usage.bytes_streamed)
        return GenerationOutput(result.files, usage)

    def _after_wave(self) -> None:
        """After a failed wave is answered: every rank rebuilds its runtime before the next one."""
        if not self._needs_rebuild or self.fatal_error is not None:
            return
        self._needs_rebuild = False
        logger.warning("a wave failed: rebuilding the runtime on every rank")
        self._exchange(WaveMessage(WaveKind.RECOVER), self.runtime.rebuild)
        if self.runtime.omni is not None:
            self.omni = self.runtime.omni
            self._offload_stats = self.omni.stats()

    def _ping(self) -> None:
        """Idle: check that every rank's heartbeat still moves."""
        if self.fatal_error is None:
            try:
                self.channel.check_alive()
            except RankGroupError as e:
                self._lose_group(e)

    def _exchange(self, message: WaveMessage, action: Callable[[], None]) -> None:
        try:
            self.channel.broadcast(message)
            action()
            outcomes = self.channel.gather(RankOutcome(0, self.runtime.host_bytes()))
        except RankGroupError as e:
            self._lose_group(e)
            return
        except Exception as e:  # a rebuild that failed on this rank: the group cannot go on either
            self._lose_group(RankGroupError(f"rank 0 could not rebuild its runtime: {e}"))
            raise
        assert outcomes is not None
        with self._lock:
            self._rank_host_bytes = [o.host_bytes for o in outcomes]

    def _lose_group(self, error: RankGroupError) -> None:
        logger.error("%s; answering 503 and stopping the server", error)
        self.fatal_error = error
        dropped = self.queue.close()
        logger.info("%d waiting request(s) answered 503", dropped)
        self.on_fatal()

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"a serving rank failed: {self.fatal_error}", code="rank_failed")

    def stop_ranks(self) -> bool:
        """After the worker has exited: tell every rank to leave (False when the group is already lost)."""
        if self.fatal_error is not None:
            return False
        try:
            self.channel.broadcast(WaveMessage(WaveKind.STOP))
        except RankGroupError as e:
            logger.error("%s", e)
            return False
        return True

    # reports ---------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        report = super().health()
        setup = self.runtime.setup
        if self.fatal_error is not None:
            report["status"] = "failed"
        with self._lock:
            host_bytes = list(self._rank_host_bytes)
        report["world_size"] = setup.world_size
        report["backend"] = setup.backend
        report["ranks"] = [{"rank": rank, "host_bytes": b} for rank, b in enumerate(host_bytes)]
        return report

    def render_metrics(self) -> str:
        with self._lock:
            families = [
                CounterMetricFamily("layerstream_waves", "Waves run: each rank one request, one batch or a placeholder.",
                                    value=self.num_waves),
                CounterMetricFamily("layerstream_wave_idle_ranks",
                                    "Ranks that ran a placeholder for lack of a request, over waves.",
                                    value=self.num_idle_rank_waves),
                CounterMetricFamily("layerstream_placeholder_steps",
                                    "Denoising steps run on placeholders (outputs dropped).",
                                    value=self.num_placeholder_steps),
            ]  # fmt: skip
        families.append(GaugeMetricFamily("layerstream_world_size", "Serving ranks.", value=self.runtime.setup.world_size))
        return super().render_metrics() + render_families(families)


def _stop_reason(jobs: Sequence[Job]) -> StopReason | None:
    """Why the wave stops: once every request of it has asked to (the first one's reason), else None."""
    reasons = [job.stop_signal.reason for job in jobs]
    return reasons[0] if all(r is not None for r in reasons) else None
