"""`GenerationService`: one `Omni`, its queue and worker thread, and what the HTTP layer asks of them.

The app turns HTTP into calls here and the answers back into HTTP; everything that touches the pipeline
runs on the queue's single worker thread. A request runs alone (`Omni.run` once per output) or, with
--max-batch-size above 1, in a batch with other queued requests of the same `batch_shape()` (`Omni.run_batch`
once for all their outputs), so that every streamed block is copied once per step for the whole batch.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from layerstream.omni import RunStats
from layerstream.runtime.reporting.stats import OffloadStats
from layerstream.request import GenerationError, GenerationRequest
from layerstream.server.limits import (
    ModelLimits,
    check_endpoint,
    check_image_presence,
    check_request,
    image_size_for,
    read_model_limits,
    request_shape,
)
from layerstream.outputs import OutputEncoding, default_encoding
from layerstream.server.metrics import JobOutcome, QueueState, ServerMetrics
from layerstream.server.queue import BatchOutcome, BatchPolicy, GenerationQueue, Job
from layerstream.server.schemas import GenerationUsage, ImageGenerationRequest, VideoGenerationRequest
from layerstream.server.settings import STOP_WAIT_SECONDS, ServeSettings
from layerstream.server.stopping import GenerationStopped, StopReason

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServedRequest:
    """A request checked against the served model: the `GenerationRequest` it runs (the model's defaults and
    its first seed filled in, the shape its checks priced) and what the checks found."""

    request: GenerationRequest
    size_note: str | None = None
    """With an input image: how the output size was reached."""
    work: int = 0
    """width x height x frames x steps x n, as the work cap priced it."""
    encoding: OutputEncoding | None = None
    """How each output becomes its file (None: PNG for images, MP4 for video), encoded once, on the worker."""

    def encode(self, result: Any) -> bytes:
        return (self.encoding or default_encoding(result.kind)).encode(result)

    def batch_key(self) -> GenerationRequest | None:
        """What it must share with others to run in one pipeline call with them (its `batch_shape()`); None: it
        runs alone (an input image: pipelines take one image per call)."""
        return None if self.request.image is not None else self.request.batch_shape()


class StepObserver(Protocol):
    """Follows one generation on the worker thread, between its denoising steps (a job's progress)."""

    wants_latents: bool
    """Whether `latents` is called (it costs a look at the latents each step)."""

    def stepped(self, step: int, total: int, seconds: float, stats: OffloadStats | None) -> None:
        """After step `step` of `total`, which took `seconds`; `stats`: the offload counters now."""

    def latents(self, step: int, total: int, latents: Any) -> None:
        """The latents after step `step`: to read, never to change."""


@dataclass(frozen=True)
class GenerationOutput:
    """What the worker hands back: the encoded files, one per seed, and the cost of making them."""

    files: list[bytes]
    usage: GenerationUsage


class GenerationService:
    """Serves one loaded `Omni`: checks requests against its model, queues them, runs them one at a time."""

    def __init__(self, omni: Any, settings: ServeSettings, *, metrics: ServerMetrics | None = None):
        self.omni = omni
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.limits: ModelLimits = read_model_limits(omni, settings)
        batching = None
        if settings.max_batch_size > 1:
            # the work cap bounds a batch as it bounds a request: the time and memory of one pipeline call
            batching = BatchPolicy(
                max_batch_size=settings.max_batch_size,
                wait_seconds=settings.batch_wait_ms / 1000,
                max_cost=self.limits.max_work,
            )
        self.queue = GenerationQueue(settings.max_queue, batching=batching, run_batch=self._generate_batch)
        # /metrics reads this snapshot, refreshed by the worker between jobs, rather than the live runtime
        # from the event loop: the counters are then never read halfway through a forward
        self._offload_stats = omni.stats()
        self._drained_at: float | None = None
        self._grace_timer: threading.Timer | None = None

    # lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.queue.start()

    def drain(self) -> None:
        """Stop taking requests, answer the waiting ones 503, and give the running one --shutdown-timeout s.

        Past that grace period the running generation is stopped at its next denoising step (answered 503).
        """
        if self.queue.closed:
            return
        self._drained_at = time.monotonic()
        dropped = self.queue.close()
        grace = self.settings.shutdown_timeout
        running = f"the running generation has {grace:g} s to finish" if self.queue.running else "nothing running"
        logger.info("draining: %d waiting request(s) answered 503; %s", dropped, running)
        # a timer thread, not the event loop: the loop is busy shutting uvicorn down and must not be relied on
        self._grace_timer = threading.Timer(grace, self.queue.stop_running, args=(StopReason.SHUTDOWN,))
        self._grace_timer.daemon = True
        self._grace_timer.start()

    def stop(self) -> bool:
        """Drain, then wait for the worker thread to exit, at most until the stop's bound; True if it did.

        The bound is --shutdown-timeout plus `STOP_WAIT_SECONDS` from the drain: time for a stopped
        generation to reach its next step boundary. A step longer than that is left behind (the worker is a
        daemon thread), so the process still exits in bounded time.
        """
        self.drain()
        assert self._drained_at is not None  # set by drain()
        deadline = self._drained_at + self.settings.shutdown_timeout + STOP_WAIT_SECONDS
        finished = self.queue.join(max(0.0, deadline - time.monotonic()))
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        if not finished:
            logger.warning("the running generation did not stop in time; leaving it behind")
        return finished

    # requests --------------------------------------------------------------------------------------------------
    def check_endpoint(self, endpoint_kind: str) -> None:
        """400 `ApiError` if the model does not make this kind of output (checked before the body is read)."""
        check_endpoint(self.limits, endpoint_kind)

    def check_image_presence(self, *, has_image: bool, endpoint: str, field: str = "image", how: str | None = None) -> None:
        """400 naming `field` if a request sends an image the model does not take, or lacks one it needs."""
        check_image_presence(self.limits, has_image=has_image, endpoint=endpoint, field=field, how=how)

    def body_limit(self, endpoint_kind: str) -> int:
        """Largest body of a request to this endpoint: more when it may carry an input image."""
        takes_image = endpoint_kind == "edit" or (endpoint_kind == "video" and self.limits.image_input != "none")
        return self.settings.image_body_bytes if takes_image else self.settings.max_body_bytes

    def read_image(self, data: bytes, field: str = "image") -> Any:
        """The input image in `data`, checked against the caps; 400 (413 when too large) naming `field`.

        Called off the event loop: decoding a large image takes a while."""
        from layerstream.models.input_image import InputImageError, read_input_image
        from layerstream.server.errors import ApiError

        try:
            return read_input_image(
                data, name=field, max_pixels=self.settings.max_image_pixels, max_bytes=self.settings.max_image_bytes
            )
        except InputImageError as e:
            raise ApiError(413 if e.too_large else 400, str(e), code="invalid_image", param=field) from None

    def prepare(self, body: ImageGenerationRequest, image: Any = None, image_field: str = "image") -> ServedRequest:
        """Check `body` (and its decoded input `image`, sent as `image_field`, if any) against the model (400
        `ApiError` if it cannot run) and fix its shape and seeds. Without a size, an image's own size (rounded to
        the model's size multiple, within its largest side) is the output size, and it is what the work cap
        prices."""
        conditioned = image_size_for(body, self.limits, image.size, image_field) if image is not None else None
        check_request(body, self.limits, conditioned)
        # the checks above priced this shape; run exactly it, not whatever the pipeline would default to
        shape = request_shape(body, self.limits, conditioned)
        # a random seed is drawn small (under 2**32): easy to read back from the response and type again
        first_seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
        request = replace(
            body.generation_request(seed=first_seed, image=image),
            width=shape.width,
            height=shape.height,
            num_frames=shape.num_frames,
            num_inference_steps=shape.num_inference_steps,
        )
        if self.limits.kind == "video" and request.fps is None:
            request = replace(request, fps=self.limits.fps)  # what the MP4 is encoded at, shown in the job's settings
        note = conditioned.note if conditioned is not None else None
        encoding = None
        if isinstance(body, ImageGenerationRequest):  # the body's format, encoded once on the worker
            encoding = OutputEncoding(body.output_format, body.output_compression)
        return ServedRequest(request=request, size_note=note, work=shape.work(self.limits), encoding=encoding)

    def submit(self, served: ServedRequest) -> Job:
        """Queue a generation, with the request's timeout; raises `QueueFullError` or `QueueClosedError` instead
        of queueing."""
        return self.queue.submit(
            lambda job: self.generate(served, job),
            timeout=served.request.timeout,
            request=served,
            batch_key=served.batch_key(),
            cost=served.work,
        )

    def generate(self, served: ServedRequest, job: Job, observer: StepObserver | None = None) -> GenerationOutput:
        """Run on the worker thread: one `Omni.run` per output, each encoded and released before the next.

        Between denoising steps, and before each output, it stops if the event loop asked it to
        (`GenerationStopped`); then `observer`, if any, hears of the step.
        """
        started = time.perf_counter()
        bytes_before = self._bytes_streamed()
        files: list[bytes] = []
        runs: list[RunStats] = []  # all a response needs of an output once its file is encoded
        frames_shape: tuple[int, ...] = ()
        outcome = JobOutcome.ERROR
        request = served.request
        num_outputs = request.n
        try:
            for index, output in enumerate(request.outputs()):
                where = f"output {index + 1} of {num_outputs}"
                job.stop_signal.raise_if_requested(f"before {where}")

                def stop_if_asked(step: int, total: int, seconds: float, where: str = where) -> None:
                    job.stop_signal.raise_if_requested(f"after step {step} of {total} ({where})")
                    if observer is not None:  # between steps, on this thread: the counters are whole
                        observer.stepped(step, total, seconds, self.omni.stats())

                on_latents = observer.latents if observer is not None and observer.wants_latents else None
                result = self.omni.run(output, on_step=stop_if_asked, on_latents=on_latents)
                files.append(served.encode(result))
                runs.append(result.stats)
                frames_shape = result.frames.shape
                # drop the float and uint8 frames now: otherwise `result` holds them while the next output runs
                del result
            outcome = JobOutcome.OK
        except GenerationStopped as e:  # asked for: one line, no traceback
            outcome = JobOutcome.STOPPED
            logger.info("%s (prompt %r)", e, request.prompt[:80])
            raise
        except GenerationError as e:  # arguments the pipeline refused: the client's to fix, answered 400
            logger.info("generation refused: %s", e)
            raise
        except Exception:
            logger.exception("generation failed (prompt %r)", request.prompt[:80])
            raise
        finally:
            self._offload_stats = self.omni.stats()
            seconds = time.perf_counter() - started
            self.metrics.observe_job(
                queue_seconds=job.queue_seconds, seconds=seconds, num_outputs=num_outputs, outcome=outcome
            )
            self.metrics.observe_batch(1)
            if bytes_before is not None:
                self.metrics.observe_request_bytes(self._bytes_streamed() - bytes_before)
        usage = request_usage(self.limits, served, runs, frames_shape, job.queue_seconds)
        return GenerationOutput(files, usage)

    def _generate_batch(self, jobs: Sequence[Job]) -> list[BatchOutcome]:
        """Run on the worker thread: the requests of `jobs` (one batch shape) as one `Omni.run_batch` call,
        an output per seed of each; then each request's outputs encoded into its own answer.

        A request asked to stop (its timeout, its client gone) does not stop the others: its outputs are
        dropped and it fails with `GenerationStopped`. The call itself stops at the next step only once every
        request of the batch has asked to. A call that raises fails every request of the batch (the queue
        answers each), and the runtime is left clean for the next, as after a request run alone.
        """
        started = time.perf_counter()
        bytes_before = self._bytes_streamed()
        # a request asked to stop before the call starts is left out of it: less work for the others
        running = [job for job in jobs if job.stop_signal.reason is None]
        outcome = JobOutcome.ERROR
        results: list[Any] = []
        try:
            results = self._call_batch(running) if running else []
            outcome = JobOutcome.OK
        except GenerationStopped as e:  # every request asked to stop: one line, no traceback
            outcome = JobOutcome.STOPPED
            logger.info("%s", e)
            raise
        except GenerationError as e:
            logger.info("generation refused: %s", e)
            raise
        except Exception:
            prompts = [job.request.request.prompt[:40] for job in running]
            logger.exception("generation of a batch of %d request(s) failed (prompts %r)", len(running), prompts)
            raise
        finally:
            self._offload_stats = self.omni.stats()
            bytes_after = self._bytes_streamed()
            bytes_streamed = None if bytes_after is None or bytes_before is None else bytes_after - bytes_before
            self._observe_batch(jobs, running, outcome, time.perf_counter() - started, bytes_streamed)
        return self._batch_answers(jobs, running, results)

    def _call_batch(self, running: list[Job]) -> list[Any]:
        """One `Omni.run_batch` for the outputs of `running`, in order; stops between steps once every one of
        them has been asked to."""
        requests = [job.request.request for job in running]
        where = f"a batch of {len(requests)} request(s), {sum(r.n for r in requests)} output(s)"

        def stop_if_all_asked(step: int, total: int, seconds: float) -> None:
            if all(job.stop_signal.reason is not None for job in running):
                running[0].stop_signal.raise_if_requested(f"after step {step} of {total} ({where})")

        return self.omni.run_batch(requests, on_step=stop_if_all_asked)

    def _observe_batch(
        self, jobs: Sequence[Job], running: list[Job], outcome: JobOutcome, seconds: float, bytes_streamed: int | None
    ) -> None:
        self.metrics.observe_batch(len(jobs))
        num_outputs = sum(job.request.request.n for job in running)
        for job in jobs:
            num_job_outputs = job.request.request.n
            # a request left out of the call, or asked to stop during it, is stopped whatever the call did
            stopped = job not in running or job.stop_signal.reason is not None
            self.metrics.observe_job(
                queue_seconds=job.queue_seconds,
                # its own share of the call, by outputs (a batch of 4 taking 61 s adds 61 s, not 244); none if
                # it was left out of the call
                seconds=seconds * num_job_outputs / num_outputs if job in running else None,
                num_outputs=num_job_outputs,
                outcome=JobOutcome.STOPPED if stopped else outcome,
            )
            if bytes_streamed is not None and job in running:
                self.metrics.observe_request_bytes(bytes_streamed * num_job_outputs // num_outputs)

    def _batch_answers(self, jobs: Sequence[Job], running: list[Job], results: list[Any]) -> list[BatchOutcome]:
        """Each request's answer: its outputs encoded (each released once encoded), or `GenerationStopped`."""
        answers: list[BatchOutcome] = []
        num_outputs = len(results)
        offset = 0  # where the running job's outputs start in `results`
        for job in jobs:
            served: ServedRequest = job.request
            if job not in running:
                answers.append(_stopped_in_batch(job, len(jobs), "before its batch started"))
                continue
            mine = range(offset, offset + served.request.n)
            offset += served.request.n
            if job.stop_signal.reason is not None:
                answers.append(_stopped_in_batch(job, len(jobs), "during its batch, whose other requests ran on"))
                continue
            call, frames_shape = results[mine[0]].stats, results[mine[0]].frames.shape
            files = []
            for k in mine:
                files.append(served.encode(results[k]))
                results[k] = None  # its float and uint8 frames are not needed once encoded
            usage = request_usage(self.limits, served, [call], frames_shape, job.queue_seconds, batch_size=len(jobs))
            # its share, by outputs, of the call's bytes: what a request costs, which batching divides
            share = call.bytes_transferred * len(mine) // num_outputs
            answers.append(GenerationOutput(files, usage.model_copy(update={"bytes_streamed": share})))
        return answers

    def _bytes_streamed(self) -> int | None:
        stats = self.omni.stats()
        return stats.bytes_transferred if stats is not None else None

    # reports ---------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        omni = self.omni
        return {
            "status": "draining" if self.queue.closed else "ok",
            "model": self.limits.model,
            "model_source": omni.source.to_dict(),  # a Hub id's revision and commit, or the folder
            "kind": self.limits.kind,
            "device": str(omni.device),
            "dtype": str(omni.dtype).removeprefix("torch.") if omni.dtype is not None else None,
            "component_dtypes": omni.component_dtypes(),
            "offload_config": omni.config.to_dict(),
            "queue_depth": self.queue.depth,
            "max_queue": self.queue.max_waiting,
            "running": self.queue.running,
            "size_multiple": self.limits.size_multiple,
            "frame_multiple": self.limits.frame_multiple,
            "max_frames": self.limits.max_frames if self.limits.kind == "video" else None,
            "max_side_pixels": self.limits.max_side_pixels,
            "max_work": self.limits.max_work,
            "image_input": self.limits.image_input,
            "max_image_bytes": self.settings.max_image_bytes,
            "max_image_pixels": self.settings.max_image_pixels,
            "max_batch_size": self.settings.max_batch_size,
            "batch_wait_ms": self.settings.batch_wait_ms,
            "world_size": 1,
            "backend": None,
            "ranks": [{"rank": 0, "host_bytes": getattr(self._offload_stats, "host_bytes", None)}],
            **self._page_defaults(),
        }

    def _page_defaults(self) -> dict[str, Any]:
        """What a page needs to fill its form: the model's defaults, and where its jobs are (the app sets
        ``jobs_path`` when it serves the job API)."""
        limits = self.limits
        width, height = limits.default_width, limits.default_height
        is_video = limits.kind == "video"
        return {
            "default_size": f"{width}x{height}" if width and height else None,
            "default_num_frames": limits.default_num_frames if is_video else None,
            "default_steps": limits.default_num_inference_steps,
            "fps": limits.fps if is_video else None,
            "takes_image": limits.image_input != "none",
            "jobs_path": None,
        }

    def render_metrics(self) -> str:
        queue = self.queue
        state = QueueState(
            depth=queue.depth,
            max_waiting=queue.max_waiting,
            running=queue.running,
            num_submitted=queue.num_submitted,
            num_started=queue.num_started,
            num_running=queue.num_running,
        )
        labels = {"model": self.limits.model, "kind": self.limits.kind, "device": str(self.omni.device)}
        return self.metrics.render(queue=state, offload=self._offload_stats, labels=labels)


def _stopped_in_batch(job: Job, batch_size: int, where: str) -> GenerationStopped:
    reason = job.stop_signal.reason
    assert reason is not None  # only called for a job asked to stop
    logger.info("generation stopped (%s) %s of %d; its outputs are dropped", reason, where, batch_size)
    return GenerationStopped(reason, f"generation stopped ({reason}) {where} of {batch_size}")


def request_usage(
    limits: ModelLimits,
    served: ServedRequest,
    runs: list[RunStats],
    frames_shape: tuple[int, ...],
    queue_seconds: float,
    *,
    batch_size: int = 1,
) -> GenerationUsage:
    """The cost of a request, summed over its outputs (`runs`: one per output, or its batch's one call);
    `frames_shape` is one output's [frames, H, W, 3]."""
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
    )
