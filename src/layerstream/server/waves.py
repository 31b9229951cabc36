"""Rank 0 of a multi-rank server: waves of requests, one share per rank. `WavePolicy` takes the head of the queue and
the requests that can run beside it, one (or one batch) per rank: every rank must run the same forwards, as allgather
gathers each block once per forward on every rank, and a rank without a request runs a placeholder whose outputs are
dropped. `RankRunner` leads each wave and answers: 500 for a wave that raised (then every rank rebuilds), 503 for a rank
lost (then the server stops)."""

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
from layerstream.server.limits import ModelLimits
from layerstream.server.metrics import JobOutcome, ServerMetrics
from layerstream.server.output_loop import GroupWork
from layerstream.server.queue import Job, Take
from layerstream.server.ranks import (
    ControlChannel,
    RankGroupError,
    RankOutcome,
    RankRuntime,
    WaveKind,
    WaveMessage,
    lead_wave,
)
from layerstream.server.served import Answer, RunnerBase, ServedRequest, StepObserver, job_output, observe_call
from layerstream.server.stopping import GenerationStopped, StopReason

logger = logging.getLogger(__name__)

ServedJob = Job[ServedRequest]


class WaveFailedError(LayerstreamError, RuntimeError):
    """A wave's generation raised on some rank; every request of the wave is answered 500 with it."""


def wave_key(served: ServedRequest) -> Hashable:
    """What requests run alone must share to run side by side in one wave (images may differ)."""
    request = served.request
    return replace(request.batch_shape(), image=None), request.n, request.image is not None


@dataclass(frozen=True, kw_only=True)
class WavePolicy:
    """Takes a wave at a time: groups of jobs, one group per rank (a `queue.TakePolicy`)."""

    num_ranks: int
    max_batch_size: int  # requests of one rank's batch (1: each rank runs one request alone)
    wait_seconds: float  # longest the head waits, from its submission, for its wave to fill
    max_cost: int  # most summed `Job.cost` of one rank's batch
    idle_seconds: float  # with nothing to run this long, the worker checks on the ranks

    def take(self, waiting: Sequence[ServedJob]) -> Take:
        head = waiting[0]
        groups, capacity = self._wave_for(head, waiting)
        full = sum(map(len, groups)) >= capacity
        return Take(groups, 0.0 if full else head.submitted_at + self.wait_seconds - time.monotonic())

    def batches(self, job: ServedJob) -> bool:
        """Whether `job` runs in a batch call (else alone, an `Omni.run` per output)."""
        return self.max_batch_size > 1 and job.batch_key is not None

    def _wave_for(self, head: ServedJob, waiting: Sequence[ServedJob]) -> tuple[list[list[ServedJob]], int]:
        """The groups of a wave headed by `head` (spread over the ranks first), and the most jobs it could hold."""
        batching = self.batches(head)
        per_rank = self.max_batch_size if batching else 1
        key = head.batch_key if batching else wave_key(head.served)
        groups, costs = [[head]], [head.cost]
        for job in waiting:
            if job is head or (job.batch_key if batching else wave_key(job.served)) != key:
                continue
            if len(groups) < self.num_ranks:  # spread first: ranks run side by side
                groups.append([job])
                costs.append(job.cost)
                continue
            room = [i for i, g in enumerate(groups) if len(g) < per_rank and costs[i] + job.cost <= self.max_cost]
            if not room:
                if all(len(g) >= per_rank for g in groups):
                    break
                continue
            smallest = min(room, key=lambda i: len(groups[i]))
            groups[smallest].append(job)
            costs[smallest] += job.cost
        return groups, self.num_ranks * per_rank


class RankRunner(RunnerBase):
    """The queue's runner on rank 0 of several: each run is a wave, every rank its group (or a placeholder)."""

    def __init__(
        self, runtime: RankRuntime, channel: ControlChannel, policy: WavePolicy, limits: ModelLimits, metrics: ServerMetrics,
        *, on_fatal: Callable[[], None] = lambda: None,
    ):  # fmt: skip
        self.runtime = runtime
        self.channel = channel
        self.policy = policy
        self.limits = limits
        self.metrics = metrics
        self.offload_stats = runtime.omni.stats()
        self._lock = threading.Lock()
        self._wave_id = 0
        self._needs_rebuild = False
        self._rank_host_bytes: list[int | None] = [None] * runtime.setup.world_size
        self.num_waves = 0
        self.num_idle_rank_waves = 0
        self.num_placeholder_steps = 0
        self.fatal_error: RankGroupError | None = None
        self.on_fatal: Callable[[], None] = lambda: None  # a rank lost before serving: the service reads fatal_error
        channel.wait_for_ranks()  # a rank still loading has no heartbeat yet: the exchange would take it for lost
        self._exchange(WaveMessage(WaveKind.PING), lambda: None)  # every rank's host bytes, for /health
        self.on_fatal = on_fatal  # the service's: close the queue and stop serving (the process exits non-zero)

    @property
    def omni(self) -> Any:
        return self.runtime.omni

    def run(self, groups: list[list[ServedJob]]) -> list[Answer]:
        """One wave; one answer per job. A job whose observer fails as it starts is answered so and left out."""
        jobs = [job for group in groups for job in group]
        if self.fatal_error is not None:
            return [self._unavailable()] * len(jobs)
        refused = _start_observers(jobs)
        running = [group for group in ([job for job in g if id(job) not in refused] for g in groups) if group]
        answers = iter(self._run_wave(running) if running else [])
        return [refused[id(job)] if id(job) in refused else next(answers) for job in jobs]

    def _run_wave(self, groups: list[list[ServedJob]]) -> list[Answer]:
        jobs = [job for group in groups for job in group]
        works = [GroupWork.of(g, batch_call=self.policy.batches(g[0])) for g in groups]
        num_idle = self.runtime.setup.world_size - len(works)
        works += [works[0].as_placeholder()] * num_idle
        self._wave_id += 1
        message = WaveMessage(WaveKind.RUN, self._wave_id, tuple(works))
        started = time.perf_counter()
        try:
            observer = _WaveObserver.of(jobs, groups[0])
            outcomes = lead_wave(self.channel, self.runtime, message, lambda: _stop_reason(jobs), observer)
        except RankGroupError as e:
            self._lose_group(e)
            return [self._unavailable()] * len(jobs)
        finally:
            self.offload_stats = self.runtime.omni.stats()
        seconds = time.perf_counter() - started
        with self._lock:
            self.num_waves += 1
            self.num_idle_rank_waves += num_idle
            self.num_placeholder_steps += sum(o.num_placeholder_steps for o in outcomes)
            self._rank_host_bytes = [o.host_bytes for o in outcomes]
        return self._answers(groups, outcomes, seconds)

    def _answers(self, groups: list[list[ServedJob]], outcomes: list[RankOutcome], seconds: float) -> list[Answer]:
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
        answers: list[Answer] = []
        for group, outcome in zip(groups, outcomes):
            num_outputs = sum(len(r.files) for r in outcome.results)  # what its rank's call made
            job_outcomes = []
            for index, job in enumerate(group):
                # a request asked to stop is answered so, whatever the wave did: its outputs are dropped
                asked = job.stop_signal.reason or (stopped if failure is None else None)
                if asked is not None:
                    answer: Answer = GenerationStopped(asked, f"generation stopped ({asked}) during its wave")
                    job_outcomes.append(JobOutcome.STOPPED)
                elif failure is not None:
                    answer = failure
                    job_outcomes.append(JobOutcome.ERROR)
                else:
                    shared = num_outputs if self.policy.batches(job) else None  # a batch call's outputs
                    answer = job_output(
                        self.limits, self.metrics, job, outcome.results[index], batch_size=len(group), call_outputs=shared
                    )
                    job_outcomes.append(JobOutcome.OK)
                answers.append(answer)
            observe_call(self.metrics, group, job_outcomes, seconds, [True] * len(group))  # its share of its rank's call
        return answers

    def after_run(self) -> None:
        """After a failed wave is answered: every rank rebuilds its runtime before the next one."""
        if not self._needs_rebuild or self.fatal_error is not None:
            return
        self._needs_rebuild = False
        logger.warning("a wave failed: rebuilding the runtime on every rank")
        self.rebuilding = "the last wave failed: every rank is rebuilding its runtime; requests wait in the queue"
        try:
            self._exchange(WaveMessage(WaveKind.RECOVER), self.runtime.rebuild)
        finally:
            self.rebuilding = None
        if self.runtime.omni is not None:
            self.offload_stats = self.runtime.omni.stats()

    def idle(self) -> None:  # check that every rank's heartbeat still moves
        if self.fatal_error is None:
            try:
                self.channel.check_alive()
            except RankGroupError as e:
                self._lose_group(e)

    def leave(self) -> bool:
        """After the worker has exited: tell every other rank to leave (False when the group is lost)."""
        if self.fatal_error is not None:
            return False
        try:
            self.channel.broadcast(WaveMessage(WaveKind.STOP))
        except RankGroupError as e:
            logger.error("%s", e)
            return False
        return True

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
        self.on_fatal()

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"a serving rank failed: {self.fatal_error}", code="rank_failed")

    def report(self) -> dict[str, Any]:
        setup = self.runtime.setup
        with self._lock:
            host_bytes = list(self._rank_host_bytes)
        ranks = [{"rank": rank, "host_bytes": b} for rank, b in enumerate(host_bytes)]
        failed = {"status": "failed"} if self.fatal_error is not None else {}
        return {"world_size": setup.world_size, "backend": setup.backend, "ranks": ranks, **failed}

    def metric_families(self) -> list[Any]:
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
        return families


class _WaveObserver:
    """Rank 0's steps told to every followed job of the wave (the ranks run the same forwards); latents, for
    previews, only to rank 0's own job when it runs alone."""

    @classmethod
    def of(cls, jobs: list[ServedJob], rank0_group: list[ServedJob]) -> _WaveObserver | None:
        # None when no job is followed: the steps then cost no look at the counters
        observers = [job.observer for job in jobs if job.observer is not None]
        return cls(observers, rank0_group[0].observer if len(rank0_group) == 1 else None) if observers else None

    def __init__(self, observers: list[StepObserver], own: StepObserver | None):
        self._observers = observers
        self._latents_to = own if own is not None and own.wants_latents else None
        self.wants_latents = self._latents_to is not None

    def started(self) -> None:
        pass  # told before the wave was sent

    def stepped(self, step: int, total: int, seconds: float, stats: Any) -> None:
        for observer in self._observers:
            observer.stepped(step, total, seconds, stats)

    def latents(self, step: int, total: int, latents: Any) -> None:
        if self._latents_to is not None:
            self._latents_to.latents(step, total, latents)


def _start_observers(jobs: Sequence[ServedJob]) -> dict[int, Exception]:
    """Tell each job's observer that it starts; the error of each that raised, by id()."""
    refused: dict[int, Exception] = {}
    for job in jobs:
        if job.observer is not None:
            try:
                job.observer.started()
            except Exception as e:  # noqa: BLE001 - its answer: the job manager records it as the job's failure
                logger.error("a job of the wave could not be marked started (%s); it is failed, the others run", e)
                refused[id(job)] = e
    return refused


def _stop_reason(jobs: Sequence[Job]) -> StopReason | None:
    """Why the wave stops: once every request of it has asked to (the first one's reason), else None."""
    reasons = [job.stop_signal.reason for job in jobs]
    return reasons[0] if all(r is not None for r in reasons) else None
