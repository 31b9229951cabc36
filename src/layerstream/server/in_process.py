"""`InProcessRunner`: the server's runner on one process, its one `Omni`, on the queue's worker thread.
A job runs alone (`Omni.run` per output); a batch (--max-batch-size) runs as one `Omni.run_batch`, so that every
streamed block is copied once per step for the whole batch. Either way through `output_loop.run_group`."""

from __future__ import annotations

import logging
import time
from typing import Any

from layerstream.request import GenerationError
from layerstream.runtime.reporting.stats import OffloadStats
from layerstream.server.limits import ModelLimits
from layerstream.server.metrics import JobOutcome, ServerMetrics
from layerstream.server.output_loop import GroupWork, RequestResult, run_group
from layerstream.server.queue import Job
from layerstream.server.served import Answer, RunnerBase, ServedRequest, job_output, observe_call
from layerstream.server.stopping import GenerationStopped

logger = logging.getLogger(__name__)

ServedJob = Job[ServedRequest]


class InProcessRunner(RunnerBase):
    """Runs what the queue takes on `omni`: one group per run (the queue's policy takes one at a time)."""

    def __init__(self, omni: Any, limits: ModelLimits, metrics: ServerMetrics):
        self.omni = omni
        self.limits = limits
        self.metrics = metrics
        # /metrics reads this snapshot, refreshed by the worker after each run, rather than the live runtime
        # from the event loop: the counters are then never read halfway through a forward
        self.offload_stats: OffloadStats | None = omni.stats()

    def run(self, groups: list[list[ServedJob]]) -> list[Answer]:
        (group,) = groups
        return [self._run_alone(group[0])] if len(group) == 1 else self._run_batch(group)

    def report(self) -> dict[str, Any]:  # /health's ranks: one, this process
        host_bytes = self.offload_stats.host_bytes if self.offload_stats is not None else None
        return {"world_size": 1, "backend": None, "ranks": [{"rank": 0, "host_bytes": host_bytes}]}

    def _run_alone(self, job: ServedJob) -> Answer:
        served = job.served
        started = time.perf_counter()
        try:
            if job.observer is not None:
                job.observer.started()
            work = GroupWork.of([job], batch_call=False)
            (result,) = run_group(self.omni, work, job.stop_signal.raise_if_requested, observer=job.observer)
        except Exception as e:
            answer: Answer = e
            outcome = _failed(e, f"(prompt {served.prompt[:80]!r})")
        else:
            answer, outcome = job_output(self.limits, self.metrics, job, result), JobOutcome.OK
        finally:
            self.offload_stats = self.omni.stats()
        observe_call(self.metrics, [job], [outcome], time.perf_counter() - started, [True])
        return answer

    def _run_batch(self, jobs: list[ServedJob]) -> list[Answer]:
        """`jobs` as one `Omni.run_batch`; a request asked to stop has its outputs dropped, the others run on."""
        started = time.perf_counter()
        # a request asked to stop before the call starts is left out of it: less work for the others
        running = [job for job in jobs if job.stop_signal.reason is None]
        try:
            results = self._call_batch(running) if running else []
        except Exception as e:
            answers: list[Answer] = [e] * len(jobs)
            outcome = _failed(e, f"of a batch of {len(running)} request(s) (prompts {[j.served.prompt[:40] for j in running]!r})")
        else:
            answers, outcome = self._batch_answers(jobs, running, results), JobOutcome.OK
        finally:
            self.offload_stats = self.omni.stats()
        # a request left out of the call, or asked to stop during it, is stopped whatever the call did
        outcomes = [JobOutcome.STOPPED if job.stop_signal.reason is not None or job not in running else outcome for job in jobs]
        observe_call(self.metrics, jobs, outcomes, time.perf_counter() - started, [job in running for job in jobs])
        return answers

    def _call_batch(self, running: list[ServedJob]) -> list[RequestResult]:
        def stop_if_all_asked(where: str) -> None:
            if all(job.stop_signal.reason is not None for job in running):
                running[0].stop_signal.raise_if_requested(where)

        # a request asked to stop during the call is answered so: its outputs are not encoded
        work = GroupWork.of(running, batch_call=True)
        return run_group(self.omni, work, stop_if_all_asked, wanted=lambda i: running[i].stop_signal.reason is None)

    def _batch_answers(self, jobs: list[ServedJob], running: list[ServedJob], results: list[RequestResult]) -> list[Answer]:
        answers: list[Answer] = []
        num_outputs = sum(job.served.num_outputs for job in running)
        by_job = dict(zip(running, results))
        for job in jobs:
            if job not in by_job:
                answers.append(stopped_in_batch(job, len(jobs), "before its batch started"))
            elif job.stop_signal.reason is not None:
                answers.append(stopped_in_batch(job, len(jobs), "during its batch, whose other requests ran on"))
            else:
                answers.append(job_output(self.limits, self.metrics, job, by_job[job], batch_size=len(jobs), call_outputs=num_outputs))
        return answers


def _failed(error: Exception, what: str) -> JobOutcome:
    if isinstance(error, GenerationStopped):  # asked for: one line, no traceback
        logger.info("%s", error)
        return JobOutcome.STOPPED
    if isinstance(error, GenerationError):  # arguments the pipeline refused: the client's to fix, answered 400
        logger.info("generation refused: %s", error)
    else:
        logger.exception("generation %s failed", what)
    return JobOutcome.ERROR


def stopped_in_batch(job: ServedJob, batch_size: int, where: str) -> GenerationStopped:
    reason = job.stop_signal.reason
    assert reason is not None  # only called for a job asked to stop
    logger.info("generation stopped (%s) %s of %d; its outputs are dropped", reason, where, batch_size)
    return GenerationStopped(reason, f"generation stopped ({reason}) {where} of {batch_size}")
