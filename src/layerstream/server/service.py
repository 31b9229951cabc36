"""`GenerationService`: one `Omni`, its queue and worker thread, and what the HTTP layer asks of them.

The app turns HTTP into calls here and the answers back into HTTP; everything that touches the pipeline
runs on the queue's single worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from layerstream.omni import GenerationError
from layerstream.server.faults import FaultInjector
from layerstream.server.limits import ModelLimits, check_endpoint, check_request, read_model_limits
from layerstream.server.media import encode_result_b64
from layerstream.server.metrics import QueueState, ServerMetrics
from layerstream.server.queue import GenerationQueue, Job
from layerstream.server.schemas import GenerationUsage, ImageGenerationRequest, VideoGenerationRequest
from layerstream.server.settings import ServeSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """A checked request, in `Omni.generate`'s terms; `seeds` holds one seed per output."""

    prompt: str
    negative_prompt: str | None
    width: int | None
    height: int | None
    num_frames: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    seeds: tuple[int, ...]
    fps: int


@dataclass(frozen=True)
class GenerationOutput:
    """What the worker hands back: base64 files, one per seed, and the cost of making them."""

    files_b64: list[str]
    usage: GenerationUsage


class GenerationService:
    """Serves one loaded `Omni`: checks requests against its model, queues them, runs them one at a time."""

    def __init__(self, omni: Any, settings: ServeSettings, *, metrics: ServerMetrics | None = None):
        self.omni = omni
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.limits: ModelLimits = read_model_limits(
            omni, max_frames=settings.max_frames, max_side_pixels=settings.max_side_pixels
        )
        self.queue = GenerationQueue(settings.max_queue)
        self.fault = FaultInjector.install(omni, settings.fault_prompt) if settings.fault_prompt else None
        # /metrics reads this snapshot, refreshed by the worker between jobs, rather than the live runtime
        # from the event loop: the counters are then never read halfway through a forward
        self._offload_stats = omni.stats()

    # lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.queue.start()

    def drain(self) -> None:
        """Stop taking requests and answer the waiting ones 503; the running generation goes on."""
        if self.queue.closed:
            return
        dropped = self.queue.close()
        running = "finishing the running generation" if self.queue.running else "nothing running"
        logger.info("draining: %d waiting request(s) answered 503; %s", dropped, running)

    def stop(self, timeout: float | None = None) -> None:
        """Drain, then wait for the worker thread to finish its job and exit."""
        self.drain()
        if not self.queue.join(timeout):
            logger.warning("the generation worker did not finish within %s s", timeout)

    # requests --------------------------------------------------------------------------------------------------
    def check_endpoint(self, endpoint_kind: str) -> None:
        """400 `ApiError` if the model does not make this kind of output (checked before the body is read)."""
        check_endpoint(self.limits, endpoint_kind)

    def prepare(self, request: ImageGenerationRequest) -> GenerationParams:
        """Check `request` against the model (400 `ApiError` if it cannot run) and fix its seeds."""
        check_request(request, self.limits)
        size = request.width_height()
        first_seed = request.seed if request.seed is not None else secrets.randbelow(2**32)
        is_video = isinstance(request, VideoGenerationRequest)
        return GenerationParams(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_frames=request.num_frames if is_video else None,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            seeds=tuple(first_seed + i for i in range(request.n)),
            fps=request.fps if is_video else 16,
        )

    def submit(self, params: GenerationParams, *, timeout: float | None) -> Job:
        """Queue a generation; raises `QueueFullError` or `QueueClosedError` instead of queueing."""
        return self.queue.submit(lambda job: self._generate(params, job), timeout=timeout)

    def _generate(self, params: GenerationParams, job: Job) -> GenerationOutput:
        """Run on the worker thread: one `Omni.generate` per seed, each output encoded as it is made."""
        started = time.perf_counter()
        files: list[str] = []
        results = []
        try:
            with self._fault_for(params.prompt):
                for seed in params.seeds:
                    result = self.omni.generate(
                        params.prompt,
                        params.negative_prompt,
                        height=params.height,
                        width=params.width,
                        num_frames=params.num_frames,
                        num_inference_steps=params.num_inference_steps,
                        guidance_scale=params.guidance_scale,
                        seed=seed,
                        fps=params.fps,
                    )
                    files.append(encode_result_b64(result))
                    results.append(result)
        except GenerationError as e:  # arguments the pipeline refused: the client's to fix, answered 400
            logger.info("generation refused: %s", e)
            raise
        except Exception:
            logger.exception("generation failed (prompt %r)", params.prompt[:80])
            raise
        finally:
            self._offload_stats = self.omni.stats()
            self.metrics.observe_job(
                queue_seconds=job.queue_seconds,
                seconds=time.perf_counter() - started,
                num_outputs=len(params.seeds),
                ok=len(results) == len(params.seeds),
            )
        return GenerationOutput(files, _usage(self.limits.model, params, results, job.queue_seconds))

    def _fault_for(self, prompt: str) -> contextlib.AbstractContextManager:
        if self.fault is not None and self.fault.matches(prompt):
            return self.fault.armed()
        return contextlib.nullcontext()

    # reports ---------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        omni = self.omni
        return {
            "status": "draining" if self.queue.closed else "ok",
            "model": self.limits.model,
            "kind": self.limits.kind,
            "device": str(omni.device),
            "dtype": str(omni.dtype).removeprefix("torch.") if omni.dtype is not None else None,
            "offload_config": omni.config.to_dict(),
            "queue_depth": self.queue.depth,
            "max_queue": self.queue.max_waiting,
            "running": self.queue.running,
            "size_multiple": self.limits.size_multiple,
            "frame_multiple": self.limits.frame_multiple,
            "max_frames": self.limits.max_frames if self.limits.kind == "video" else None,
        }

    def render_metrics(self) -> str:
        queue = self.queue
        state = QueueState(
            depth=queue.depth,
            max_waiting=queue.max_waiting,
            running=queue.running,
            num_submitted=queue.num_submitted,
            num_started=queue.num_started,
        )
        labels = {"model": self.limits.model, "kind": self.limits.kind, "device": str(self.omni.device)}
        return self.metrics.render(queue=state, offload=self._offload_stats, labels=labels)


def _usage(model: str, params: GenerationParams, results: list, queue_seconds: float) -> GenerationUsage:
    stats = [r.stats for r in results]
    frames = results[0].frames
    step_seconds = [s for st in stats for s in st.step_seconds]
    seconds = sum(st.seconds for st in stats)
    peaks = [st.peak_device_bytes for st in stats if st.peak_device_bytes is not None]
    return GenerationUsage(
        model=model,
        seeds=list(params.seeds),
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        num_frames=int(frames.shape[0]) if results[0].kind == "video" else None,
        num_inference_steps=len(stats[0].step_seconds) or (params.num_inference_steps or 0),
        queue_seconds=queue_seconds,
        seconds=seconds,
        seconds_per_step=sum(step_seconds) / len(step_seconds) if step_seconds else seconds,
        bytes_streamed=sum(st.bytes_transferred for st in stats),
        num_transfers=sum(st.num_transfers for st in stats),
        num_sync_loads=sum(st.num_sync_loads for st in stats),
        stall_seconds=sum(st.stall_seconds for st in stats),
        device_bytes=stats[-1].device_bytes,
        host_bytes=stats[-1].host_bytes,
        peak_device_bytes=max(peaks) if peaks else None,
    )
