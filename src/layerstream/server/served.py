"""What the server's queue carries and hands back: a request checked against the served model, whoever follows
it step by step, the encoded answer with its cost (`job_output`, the one place an answer, its usage and its
metrics are made), and the protocol of the runners that make them (`ServingRunner`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

from layerstream.outputs import OutputEncoding
from layerstream.omni import RunStats
from layerstream.request import GenerationRequest
from layerstream.runtime.reporting.stats import OffloadStats
from layerstream.server.limits import ModelLimits
from layerstream.server.metrics import JobOutcome, ServerMetrics
from layerstream.server.schemas import GenerationUsage


@dataclass(frozen=True, kw_only=True)
class ServedRequest:
    """A request checked against the served model: the `GenerationRequest` it runs (the model's defaults and
    its first seed filled in, the shape its checks priced) and what the checks found."""

    request: GenerationRequest
    size_note: str | None = None  # with an input image: how the output size was reached
    work: int = 0  # its price (`models.work`)
    encoding: OutputEncoding | None = None  # None: PNG for images, MP4 for video; encoded once, where it is made

    @property
    def num_outputs(self) -> int:
        return self.request.n

    @property
    def prompt(self) -> str:
        return self.request.prompt

    def batch_key(self) -> GenerationRequest | None:
        """What it must share with others to run in one pipeline call with them (its `batch_shape()`); None: it
        runs alone (an input image: pipelines take one image per call)."""
        return None if self.request.image is not None else self.request.batch_shape()


class StepObserver(Protocol):
    """Follows one job on the worker thread: its start, and each denoising step (a job's progress)."""

    wants_latents: bool
    """Whether `latents` is called (it costs a look at the latents each step)."""

    def started(self) -> None:
        """The job starts now (before its first output)."""

    def stepped(self, step: int, total: int, seconds: float, stats: OffloadStats | None) -> None:
        """After step `step` of `total`, which took `seconds`; `stats`: the offload counters now."""

    def latents(self, step: int, total: int, latents: Any) -> None:
        """The latents after step `step`: to read, never to change."""


@dataclass(frozen=True)
class GenerationOutput:
    """The encoded files, one per seed, and the cost of making them."""

    files: list[bytes]
    usage: GenerationUsage


Answer = GenerationOutput | BaseException
"""A job's outcome: its output, or the exception it fails with (answered by the queue)."""


def request_usage(
    limits: ModelLimits,
    served: ServedRequest,
    runs: list[RunStats],
    frames_shape: tuple[int, ...],
    queue_seconds: float,
    *,
    batch_size: int = 1,
) -> GenerationUsage:
    """The cost of a request, summed over its outputs (`runs`: one per output, or its batch's one call)."""
    step_seconds = [s for run in runs for s in run.step_seconds]
    seconds = sum(run.seconds for run in runs)
    peaks = [run.peak_device_bytes for run in runs if run.peak_device_bytes is not None]
    return GenerationUsage(
        model=limits.model,
        seeds=list(served.request.seeds),
        width=int(frames_shape[2]),
        height=int(frames_shape[1]),
        num_frames=int(frames_shape[0]) if limits.kind == "video" else None,
        num_inference_steps=len(runs[0].step_seconds) or served.request.num_inference_steps,
        queue_seconds=queue_seconds,
        seconds=seconds,
        # the median, as Omni's and the job's: the first step also carries prompt encoding and warm-up
        seconds_per_step=statistics.median(step_seconds) if step_seconds else seconds,
        bytes_streamed=sum(run.bytes_transferred for run in runs),
        num_transfers=sum(run.num_transfers for run in runs),
        num_sync_loads=sum(run.num_sync_loads for run in runs),
        stall_seconds=sum(run.stall_seconds for run in runs),
        device_bytes=runs[-1].device_bytes,
        host_bytes=runs[-1].host_bytes,
        peak_device_bytes=max(peaks) if peaks else None,
        size_note=served.size_note,
        batch_size=batch_size,
        vae_decode=runs[-1].vae_decode.summary() if runs[-1].vae_decode is not None else None,
    )


def job_output(
    limits: ModelLimits, metrics: ServerMetrics, job: Any, result: Any, *, batch_size: int = 1, call_outputs: int | None = None,
) -> GenerationOutput:  # fmt: skip
    """The answer of `job` (a queue `Job` of a `ServedRequest`) from its `result` (an `output_loop.RequestResult`):
    its files and usage, its bytes observed. `call_outputs`: the outputs of the one batch call it shared, whose
    bytes it is charged its share of, by outputs (None: it ran alone, its runs are its own)."""
    usage = request_usage(limits, job.served, result.runs, result.frames_shape, job.queue_seconds, batch_size=batch_size)
    if call_outputs is not None:  # what a request costs, which batching divides
        share = result.runs[0].bytes_transferred * len(result.files) // call_outputs
        usage = usage.model_copy(update={"bytes_streamed": share})
    metrics.observe_request_bytes(usage.bytes_streamed)
    return GenerationOutput(result.files, usage)


def observe_call(
    metrics: ServerMetrics, jobs: Sequence[Any], outcomes: Sequence[JobOutcome], seconds: float, ran: Sequence[bool],
) -> None:  # fmt: skip
    """One pipeline call (a request alone, a batch, a rank's share of a wave) for `jobs`: each job's wait, its
    share of the call's `seconds` by outputs (none for a job that did not run in it) and its outcome."""
    metrics.observe_batch(len(jobs))
    num_outputs = sum(job.served.num_outputs for job, did in zip(jobs, ran) if did) or 1
    for job, outcome, did in zip(jobs, outcomes, ran):
        metrics.observe_job(
            queue_seconds=job.queue_seconds, num_outputs=job.served.num_outputs, outcome=outcome,
            # a batch of 4 taking 61 s adds 61 s, not 244
            seconds=seconds * job.served.num_outputs / num_outputs if did else None,
        )  # fmt: skip


class ServingRunner(Protocol):
    """What the service asks of its runner (the queue's `Runner`, and the serving side): one process's
    (`InProcessRunner`) or rank 0's of several (`RankRunner`). `RunnerBase` gives the defaults of one process."""

    omni: Any
    """The `Omni` it runs on (on ranks, rank 0's, replaced when a failed wave rebuilds it)."""
    offload_stats: OffloadStats | None
    """The offload counters after the last run (what /metrics reads, never the live runtime)."""
    fatal_error: BaseException | None
    """Why the runner can run nothing more (a rank lost); None while it can."""
    rebuilding: str | None
    """Why the runtime is being rebuilt now (a failed wave, on ranks); None when it is not."""

    def run(self, groups: list[list[Any]]) -> Sequence[Answer]: ...

    def after_run(self) -> None: ...

    def idle(self) -> None: ...

    def report(self) -> dict[str, Any]: ...  # what /health says of the ranks (world_size, backend, host bytes)

    def metric_families(self) -> list[Any]: ...  # its own Prometheus families, beside the service's

    def leave(self) -> bool: ...  # after the worker has exited: let the other ranks go (False: not told)


class RunnerBase:
    """`ServingRunner`'s defaults: one process, nothing to do between runs, no families of its own."""

    fatal_error: BaseException | None = None
    rebuilding: str | None = None

    def after_run(self) -> None:
        pass

    def idle(self) -> None:
        pass

    def metric_families(self) -> list[Any]:
        return []

    def leave(self) -> bool:
        return True
