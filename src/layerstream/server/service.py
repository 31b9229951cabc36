"""`GenerationService`: the served model's checks, its queue and the runner the queue hands jobs to (on one
process an `InProcessRunner` with a `BatchPolicy`, on several ranks a `RankRunner` with a `WavePolicy`), and what
the HTTP layer and the job API ask of them. Everything that touches the pipeline runs on the queue's one worker.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from layerstream.models.component_files import HUB_FILE_PREFIX
from layerstream.models.input_image import ImageFile
from layerstream.models.work import price_request
from layerstream.outputs import OutputEncoding
from layerstream.server.in_process import InProcessRunner
from layerstream.server.limits import (
    ModelLimits,
    check_endpoint,
    check_image_presence,
    check_request,
    image_size_for,
    read_model_limits,
    request_shape,
)
from layerstream.server.metrics import QueueState, ServerMetrics, render_families
from layerstream.server.queue import BatchPolicy, GenerationQueue, Job, TakeOne, TakePolicy
from layerstream.server.ranks import ControlChannel, RankRuntime
from layerstream.server.schemas import ImageGenerationRequest
from layerstream.server.served import GenerationOutput, ServedRequest, ServingRunner, StepObserver
from layerstream.server.settings import STOP_WAIT_SECONDS, ServeSettings
from layerstream.server.stopping import StopReason
from layerstream.server.waves import RankRunner, WavePolicy

logger = logging.getLogger(__name__)

__all__ = ["GenerationOutput", "GenerationService", "RankGroup", "ServedRequest", "StepObserver"]


@dataclass(frozen=True)
class RankGroup:
    """Rank 0's side of several serving ranks: the runtime it runs its share on, the channel to the others."""

    runtime: RankRuntime
    channel: ControlChannel
    idle_seconds: float
    """With nothing to run for this long, rank 0 checks on the other ranks."""


class GenerationService:
    """Serves one loaded `Omni` (or, with `ranks`, rank 0's of several): checks requests against its model,
    queues them, and runs them through its runner."""

    def __init__(
        self, omni: Any, settings: ServeSettings, *, metrics: ServerMetrics | None = None, ranks: RankGroup | None = None
    ):
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.limits: ModelLimits = read_model_limits(omni, settings)
        self.source = omni.source
        self.facts: dict[str, Any] = {
            "model_source": _public_source(omni.source),  # a Hub id's revision and commit; no local path
            "device": str(omni.device),
            "dtype": str(omni.dtype).removeprefix("torch.") if omni.dtype is not None else None,
            "component_dtypes": omni.component_dtypes(),
            "offload_config": _public_config(omni.config.to_dict()),
        }
        """What does not change while the server runs, read once: a rebuild replaces rank 0's `Omni`, not these."""
        work_from = "--max-work" if settings.max_work is not None else f"the default on {omni.device}"
        logger.info(
            "request caps: sides up to %d pixels%s, work up to %s (%s)", self.limits.max_side_pixels,
            f", {self.limits.max_frames} frames" if self.limits.kind == "video" else "", f"{self.limits.max_work:,}", work_from,
        )  # fmt: skip
        policy: TakePolicy
        if ranks is None:
            self.runner: ServingRunner = InProcessRunner(omni, self.limits, self.metrics)
            policy = self._batch_policy()
        else:
            policy = WavePolicy(
                num_ranks=ranks.runtime.setup.world_size,
                max_batch_size=settings.max_batch_size,
                wait_seconds=settings.batch_wait_ms / 1000,
                max_cost=self.limits.max_work,
                idle_seconds=ranks.idle_seconds,
            )
            self.runner = RankRunner(ranks.runtime, ranks.channel, policy, self.limits, self.metrics, on_fatal=self._lose_ranks)
        thread_name = "layerstream-generate" if ranks is None else "layerstream-waves"
        self.queue: GenerationQueue[ServedRequest, GenerationOutput] = GenerationQueue(
            settings.max_queue, runner=self.runner, policy=policy, thread_name=thread_name
        )
        self.on_fatal: Callable[[], None] = lambda: None
        """Set by the command line: stop serving once a rank is lost (the process then exits non-zero)."""
        self._drained_at: float | None = None
        self._grace_timer: threading.Timer | None = None

    def _batch_policy(self) -> TakePolicy:
        settings = self.settings
        if settings.max_batch_size == 1:
            return TakeOne()
        # the work cap bounds a batch as it bounds a request: the time and memory of one pipeline call
        return BatchPolicy(
            max_batch_size=settings.max_batch_size, wait_seconds=settings.batch_wait_ms / 1000, max_cost=self.limits.max_work
        )

    @property
    def omni(self) -> Any:
        """The `Omni` the runner runs on (on ranks, rank 0's, replaced when a failed wave rebuilds it)."""
        return self.runner.omni

    @property
    def fatal_error(self) -> BaseException | None:
        """With several ranks: why the group was lost (then nothing more runs)."""
        return self.runner.fatal_error

    # lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.queue.start()

    def drain(self) -> None:
        """Stop taking requests, answer the waiting ones 503, and give the running one --shutdown-timeout s, after
        which it is stopped at its next denoising step (answered 503)."""
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
        """Drain, then wait for the worker thread to exit, True if it did, at most --shutdown-timeout plus
        `STOP_WAIT_SECONDS` (for a stopped generation to reach its next step); a longer step is left behind (the
        worker is a daemon thread), so the process still exits in bounded time."""
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
        takes_image = endpoint_kind == "edit" or (endpoint_kind == "video" and self.limits.rules.image_input != "none")
        return self.settings.image_body_bytes if takes_image else self.settings.max_body_bytes

    def read_image(self, data: bytes, field: str = "image") -> ImageFile:
        """The input image in `data`, checked against the caps; 400 (413 when too large, 415 when not PNG, JPEG or
        WebP by its bytes) naming `field`. Called off the event loop. The request carries the file's bytes, not its
        pixels, decoded again wherever it runs, alike (a 12 MP JPEG: 0.12 s on a 2-core CPU)."""
        from layerstream.models.input_image import InputImageError, read_image_file
        from layerstream.server.errors import ApiError

        try:
            return read_image_file(
                data, name=field, max_pixels=self.settings.max_image_pixels, max_bytes=self.settings.max_image_bytes
            )
        except InputImageError as e:
            if e.unsupported_format:
                raise ApiError(415, str(e), code="unsupported_image_format", param=field) from None
            raise ApiError(413 if e.too_large else 400, str(e), code="invalid_image", param=field) from None

    def prepare(
        self, body: ImageGenerationRequest, image: ImageFile | None = None, image_field: str = "image"
    ) -> ServedRequest:
        """Check `body` (and its input `image`, sent as `image_field`, if any: `read_image`'s) against the model (400
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
        note = conditioned.source if conditioned is not None else None
        encoding = None
        if isinstance(body, ImageGenerationRequest):  # the body's format, encoded once on the worker
            encoding = OutputEncoding(body.output_format, body.output_compression)
        work = price_request(self.limits.rules, request, max_side_pixels=self.limits.max_side_pixels).work
        return ServedRequest(request=request, size_note=note, work=work, encoding=encoding)

    def submit(self, served: ServedRequest, observer: StepObserver | None = None) -> Job[ServedRequest]:
        """Queue a generation, with the request's timeout; raises `QueueFullError` or `QueueClosedError` instead
        of queueing. A job of the job API comes with its `observer` and runs alone (never in a batch call)."""
        return self.queue.submit(
            served,
            timeout=served.request.timeout,
            batch_key=served.batch_key() if observer is None else None,
            cost=served.work,
            observer=observer,
        )

    def _lose_ranks(self) -> None:
        dropped = self.queue.close()
        logger.info("%d waiting request(s) answered 503", dropped)
        self.on_fatal()

    # reports ---------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        rebuilding = self.runner.rebuilding
        status = "draining" if self.queue.closed else "rebuilding" if rebuilding else "ok"
        return {
            "status": status,
            "status_reason": rebuilding if status == "rebuilding" else None,
            "model": self.limits.model,
            "kind": self.limits.kind,
            **self.facts,  # model_source, device, dtype, component_dtypes, offload_config
            "queue_depth": self.queue.depth,
            "max_queue": self.queue.max_waiting,
            "running": self.queue.running,
            "size_multiple": self.limits.size_multiple,
            "frame_multiple": self.limits.frame_multiple,
            "max_frames": self.limits.max_frames if self.limits.kind == "video" else None,
            "max_side_pixels": self.limits.max_side_pixels,
            "max_work": self.limits.max_work,
            "image_input": self.limits.rules.image_input,
            "max_image_bytes": self.settings.max_image_bytes,
            "max_image_pixels": self.settings.max_image_pixels,
            "max_batch_size": self.settings.max_batch_size,
            "batch_wait_ms": self.settings.batch_wait_ms,
            **self.runner.report(),  # world_size, backend, each rank's host bytes
            **self._page_defaults(),
        }

    def _page_defaults(self) -> dict[str, Any]:
        """What a page needs to fill its form: the model's defaults, and where its jobs are (the app sets
        ``jobs_path`` when it serves the job API)."""
        limits, default = self.limits, self.limits.rules.filled()
        is_video = limits.kind == "video"
        return {
            "default_size": f"{default.width}x{default.height}" if default.width and default.height else None,
            "default_num_frames": default.num_frames if is_video else None,
            "default_steps": default.num_inference_steps,
            "fps": limits.fps if is_video else None,
            "takes_image": limits.rules.image_input != "none",
            "jobs_path": None,
        }

    def render_metrics(self) -> str:
        labels = {"model": self.limits.model, "kind": self.limits.kind, "device": self.facts["device"]}
        text = self.metrics.render(queue=QueueState.of(self.queue), offload=self.runner.offload_stats, labels=labels)
        families = self.runner.metric_families()
        return text + render_families(families) if families else text


def _public_config(config: dict[str, Any]) -> dict[str, Any]:
    """The offload config as a client may read it (in `/health`, and in a job's output file): ``disk_dir`` said to
    be set, not where (the log names it)."""
    if config.get("disk_dir") is not None:
        logger.info("offload config: disk_dir %s", config["disk_dir"])
        config = {**config, "disk_dir": "set (a local folder: the server log names it)"}
    return config


def _public_source(source: Any) -> dict[str, Any]:
    """Where the model (a `ModelSource`) came from, as a client may read it: a folder or a component's local file
    by its own name, never its path (the log names the path)."""
    public = {key: value for key, value in source.to_dict().items() if key != "folder"} | {"model": source.shown_name}
    if source.components:
        public["components"] = {n: f if f.startswith(HUB_FILE_PREFIX) else Path(f).name for n, f in source.components}
    return public
