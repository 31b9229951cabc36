"""A job as the store keeps it and as the API shows it: the `GenerationRequest` it runs and its `JobSettings`,
its status, and its live progress."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, Literal

from layerstream.models.generation_estimates import decode_steps
from layerstream.outputs import request_settings
from layerstream.procfs import peak_rss_nbytes
from layerstream.request import GenerationRequest

JobKind = Literal["video", "image"]


class JobStatus(StrEnum):
    """OpenAI's video job statuses; a job moves queued -> in_progress -> completed or failed."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


# progress: the denoising steps take it to STEPS_PERCENT, decoding to DECODED_PERCENT, the written file to 100
STEPS_PERCENT = 90
DECODED_PERCENT = 95


@dataclass(frozen=True, kw_only=True)
class JobSettings:
    """What only a job has, beside the `GenerationRequest` it runs."""

    output_format: Literal["mp4", "png"]  # encoded with `shown_settings` inside
    preview: bool = False  # preview images go out on the job's event stream
    has_input_image: bool = False  # the image itself is not kept in the history
    model_revision: str | None = None  # a Hub model's revision as asked (``main``), and the commit it was
    model_commit: str | None = None


def shown_settings(request: GenerationRequest, settings: JobSettings) -> dict[str, Any]:
    """Every setting needed to make the result again: a job object's ``layerstream.settings`` and its file's."""
    return request_settings(
        request, has_input_image=settings.has_input_image, model_revision=settings.model_revision, model_commit=settings.model_commit
    )


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """One job as stored: what it is, where it stands, and its output once completed."""

    id: str
    kind: JobKind
    model: str
    status: JobStatus
    created_at: int  # Unix seconds
    request: GenerationRequest  # defaults and seed filled in, without its input image
    settings: JobSettings
    seconds: str | None = None  # videos: OpenAI's `seconds` (as asked, or frames / fps)
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, str] | None = None  # {"code", "message"} of a failed job
    output_name: str | None = None  # under the data folder's outputs/, once completed
    output_bytes: int = 0
    figures: dict[str, Any] | None = None  # a finished job's `LiveProgress.figures` and `run_figures`

    def with_status(self, status: JobStatus, **changes: Any) -> JobRecord:
        return replace(self, status=status, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The record as the store keeps it (JSON-ready); `from_dict` reads it back."""
        request = {name: value for name, value in self.request.to_dict().items() if name != "image"}
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**data, "status": str(self.status), "request": request, "settings": asdict(self.settings)}

    @classmethod
    def from_dict(cls, data: Any) -> JobRecord:
        """A record as `to_dict` writes it; `ValueError` or `TypeError` saying what is wrong with any other data."""
        _check_fields("the record", data, _RECORD_FIELDS)
        _check_fields("settings", data["settings"], _SETTINGS_FIELDS)
        _check_fields("figures", data["figures"] or {}, _FIGURES_FIELDS, partial=True)
        return cls(**{
            **data, "status": JobStatus(data["status"]), "request": GenerationRequest.from_dict(data["request"]),
            "settings": JobSettings(**data["settings"]),
        })  # fmt: skip


_NUMBER = (int, float)
_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "kind": (str,), "model": (str,), "status": (str,), "created_at": (int,), "request": (dict,),
    "settings": (dict,), "seconds": (str, type(None)), "progress": (int,), "completed_at": (int, type(None)),
    "error": (dict, type(None)), "output_name": (str, type(None)), "output_bytes": (int,),
    "figures": (dict, type(None)),
}  # fmt: skip
_SETTINGS_FIELDS: dict[str, tuple[type, ...]] = {
    "output_format": (str,), "preview": (bool,), "has_input_image": (bool,), "model_revision": (str, type(None)),
    "model_commit": (str, type(None)),
}  # fmt: skip
_FIGURES_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "total": (int,), "seconds_per_step": (*_NUMBER, type(None)), "streamed_bytes": (int,),
    "stall_seconds": _NUMBER, "inference_time_s": (*_NUMBER, type(None)), "peak_memory_mb": (*_NUMBER, type(None)),
    "vae_decode": (str, type(None)),
}  # fmt: skip


def _check_fields(what: str, data: Any, types: dict[str, tuple[type, ...]], *, partial: bool = False) -> None:
    """`TypeError`/`ValueError` naming the first field of `data` that is missing, unknown or of another type."""
    if not isinstance(data, dict):
        raise TypeError(f"{what} is a {type(data).__name__}; expected an object")
    names = set(types) if not partial else set(types) & set(data)
    missing, unknown = sorted(names - set(data)), sorted(set(data) - set(types))
    if missing or unknown:
        raise ValueError(f"{what}: {'no ' + missing[0] if missing else 'an unknown field ' + unknown[0]}")
    for name in names:
        value = data[name]
        if not isinstance(value, types[name]) or (isinstance(value, bool) and bool not in types[name]):
            raise TypeError(f"{what}: {name} is {value!r}; expected {' or '.join(t.__name__ for t in types[name])}")


@dataclass
class LiveProgress:
    """What the worker reports while a job runs: held in memory, never stored (a restart fails the job)."""

    step: int = 0
    total_steps: int = 0
    step_seconds: list[float] = field(default_factory=list)
    streamed_bytes: int = 0
    stall_seconds: float = 0.0
    after_steps_seconds: float | None = None  # the decode and encoding expected, from `AfterStepsRate`
    decode_steps: float | None = None  # before any job finished: the decode in steps, from its traced FLOPs
    steps_done_at: float | None = None  # ``time.monotonic()`` when the last step ended

    @property
    def seconds_per_step(self) -> float | None:
        # the median after the first step: the first carries prompt encoding and warm-up
        steady = self.step_seconds[1:] or self.step_seconds
        return statistics.median(steady) if steady else None

    @property
    def eta_seconds(self) -> float | None:
        """The steps left and the decode after them; None where not known or overdue: never 0 while it runs."""
        per_step = self.seconds_per_step
        if per_step is None:
            return None
        steps_left = per_step * max(0, self.total_steps - self.step)
        after_steps = self.after_steps_seconds
        if after_steps is None and self.decode_steps is not None:
            after_steps = self.decode_steps * per_step
        if self.steps_done_at is None:
            return steps_left + (after_steps or 0.0)
        if after_steps is None:
            return None
        left = after_steps - (time.monotonic() - self.steps_done_at)
        return left if left > 0 else None

    def figures(self) -> dict[str, Any]:
        """What a finished job keeps of its progress."""
        return {"step": self.step, "total": self.total_steps, "seconds_per_step": self.seconds_per_step,
                "streamed_bytes": self.streamed_bytes, "stall_seconds": self.stall_seconds}  # fmt: skip

    @classmethod
    def from_figures(cls, figures: dict[str, Any]) -> LiveProgress:
        per_step = figures.get("seconds_per_step")
        return cls(
            step=figures.get("step", 0), total_steps=figures.get("total", 0),
            step_seconds=[per_step] if per_step is not None else [], streamed_bytes=figures.get("streamed_bytes", 0),
            stall_seconds=figures.get("stall_seconds", 0.0),
        )  # fmt: skip

    def percent(self) -> int:
        if self.total_steps <= 0:
            return 0
        return math.floor(STEPS_PERCENT * self.step / self.total_steps)

    def event(self, progress: int) -> dict[str, Any]:  # a ``progress`` event's data
        return {**self.figures(), "progress": progress, "eta_seconds": self.eta_seconds}


def planned_decode_steps(pipeline: Any, request: GenerationRequest) -> float | None:
    """The decode's work in steps of `request` (None without a size or a VAE)."""
    if not (request.width and request.height):
        return None
    forwards = 1 if request.guidance_scale is not None and request.guidance_scale <= 1 else 2  # guidance: 2 a step
    size = {"height": request.height, "width": request.width, "num_frames": request.num_frames or 1}
    return decode_steps(pipeline, size, forwards)


def run_figures(usage: Any) -> dict[str, float | str | None]:
    """vllm-omni's figures of a completed job: ``inference_time_s`` (the pipeline call, encoding excluded) and
    ``peak_memory_mb`` (the device's peak; on a CPU, the process's ``VmHWM``); and how the VAE decoded."""
    peak = usage.peak_device_bytes if usage.peak_device_bytes is not None else peak_rss_nbytes()
    return {
        "inference_time_s": round(usage.seconds, 6),
        "peak_memory_mb": round(peak / 2**20, 3) if peak is not None else None,
        "vae_decode": usage.vae_decode,
    }


def job_object(record: JobRecord, live: LiveProgress | None, queue_position: int | None) -> dict[str, Any]:
    """The job object of the API (OpenAI's video object, or its image twin), with the ``layerstream`` extension."""
    if live is None:
        live = LiveProgress.from_figures(record.figures) if record.figures else LiveProgress()
    settings = shown_settings(record.request, record.settings)
    body: dict[str, Any] = {
        "id": record.id, "object": record.kind, "status": str(record.status), "progress": record.progress,
        "created_at": record.created_at, "completed_at": record.completed_at, "size": settings["size"],
    }  # fmt: skip
    if record.kind == "video":
        body["seconds"] = record.seconds
    running, figures = record.status is JobStatus.IN_PROGRESS, record.figures or {}
    return body | {
        "model": record.model, "prompt": record.request.prompt, "error": record.error,
        "inference_time_s": figures.get("inference_time_s"), "peak_memory_mb": figures.get("peak_memory_mb"),
        "layerstream": {
            # how the decode ran is known once the job ran: tiling changes the output's bits, so it is shown
            "settings": {**settings, "vae_decode": figures.get("vae_decode")},
            "queue_position": queue_position if record.status is JobStatus.QUEUED else None,
            "step": live.step if running or record.status.finished else 0,
            "total_steps": live.total_steps or record.request.num_inference_steps,
            "seconds_per_step": live.seconds_per_step, "eta_seconds": live.eta_seconds if running else None,
            "streamed_bytes": live.streamed_bytes, "stall_seconds": live.stall_seconds,
        },
    }  # fmt: skip


@dataclass
class AfterStepsRate:
    """Seconds after the last step (mostly the VAE decode) per output pixel, from the last job that finished."""

    seconds_per_pixel: float | None = None

    def estimate(self, pixels: int | None) -> float | None:
        return None if self.seconds_per_pixel is None or not pixels else self.seconds_per_pixel * pixels

    def learn(self, progress: LiveProgress, pixels: int | None) -> None:
        if progress.steps_done_at is not None and pixels:
            self.seconds_per_pixel = (time.monotonic() - progress.steps_done_at) / pixels
