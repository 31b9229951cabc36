"""A job as the store keeps it and as the API shows it: its status, its settings, and its live progress."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

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
    """Every setting needed to make the result again (the ``layerstream.settings`` of a job object)."""

    prompt: str
    negative_prompt: str | None
    size: str
    """'WIDTHxHEIGHT' as generated."""
    num_frames: int | None
    """Videos: frames generated; None for images."""
    fps: int | None
    """Videos: frame rate of the MP4; None for images."""
    num_inference_steps: int
    seed: int
    guidance_scale: float | None
    """None: the model's default."""
    has_input_image: bool
    guidance_scale_2: float | None = None
    """vllm-omni's fields, as the request gave them (None: the model's default; and in older records)."""
    true_cfg_scale: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    model_revision: str | None = None
    """A Hub model's revision as asked (``main``) and the commit it was (`model_commit`); None for a folder or a
    tiny model, and in records written before these fields existed."""
    model_commit: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "size": self.size,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "seed": self.seed,
            "guidance_scale": self.guidance_scale,
            "guidance_scale_2": self.guidance_scale_2,
            "true_cfg_scale": self.true_cfg_scale,
            "boundary_ratio": self.boundary_ratio,
            "flow_shift": self.flow_shift,
            "has_input_image": self.has_input_image,
            "model_revision": self.model_revision,
            "model_commit": self.model_commit,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSettings:
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """One job as stored: what it is, where it stands, and its output once completed."""

    id: str
    kind: JobKind
    model: str
    status: JobStatus
    created_at: int
    """Unix seconds."""
    settings: JobSettings
    seconds: str | None = None
    """Videos: the duration as OpenAI's `seconds` field shows it (as asked, or frames / fps)."""
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, str] | None = None
    """{"code", "message"} of a failed job."""
    output_name: str | None = None
    """The output file's name under the data folder's outputs/, once completed."""
    output_bytes: int = 0
    figures: dict[str, Any] | None = None
    """A finished job's last progress figures (step, total, seconds_per_step, streamed_bytes, stall_seconds),
    and a completed one's `run_figures` (inference_time_s, peak_memory_mb)."""

    def with_status(self, status: JobStatus, **changes: Any) -> JobRecord:
        return replace(self, status=status, **changes)


@dataclass
class LiveProgress:
    """What the worker reports while a job runs: held in memory, never stored (a restart fails the job)."""

    step: int = 0
    total_steps: int = 0
    step_seconds: list[float] = field(default_factory=list)
    streamed_bytes: int = 0
    stall_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float | None:
        # the median: the first step also carries prompt encoding and warm-up
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def eta_seconds(self) -> float | None:
        per_step = self.seconds_per_step
        return None if per_step is None else per_step * max(0, self.total_steps - self.step)

    def figures(self) -> dict[str, Any]:
        """What a finished job keeps of its progress."""
        return {
            "step": self.step,
            "total": self.total_steps,
            "seconds_per_step": self.seconds_per_step,
            "streamed_bytes": self.streamed_bytes,
            "stall_seconds": self.stall_seconds,
        }

    @classmethod
    def from_figures(cls, figures: dict[str, Any]) -> LiveProgress:
        per_step = figures.get("seconds_per_step")
        return cls(
            step=figures.get("step", 0),
            total_steps=figures.get("total", 0),
            step_seconds=[per_step] if per_step is not None else [],
            streamed_bytes=figures.get("streamed_bytes", 0),
            stall_seconds=figures.get("stall_seconds", 0.0),
        )

    def percent(self) -> int:
        if self.total_steps <= 0:
            return 0
        return math.floor(STEPS_PERCENT * self.step / self.total_steps)

    def event(self, progress: int) -> dict[str, Any]:
        """The data of a ``progress`` event."""
        return {
            "step": self.step,
            "total": self.total_steps,
            "progress": progress,
            "seconds_per_step": self.seconds_per_step,
            "eta_seconds": self.eta_seconds,
            "streamed_bytes": self.streamed_bytes,
            "stall_seconds": self.stall_seconds,
        }


def run_figures(usage: Any) -> dict[str, float | None]:
    """vllm-omni's figures of a completed job, from its `GenerationUsage`: ``inference_time_s``, the pipeline
    call's seconds (encoding excluded), and ``peak_memory_mb``, the device's peak allocation during it (MiB);
    on a CPU device, which has no such counter, the process's peak resident memory so far (``VmHWM``)."""
    peak = usage.peak_device_bytes if usage.peak_device_bytes is not None else process_peak_bytes()
    return {
        "inference_time_s": round(usage.seconds, 6),
        "peak_memory_mb": round(peak / 2**20, 3) if peak is not None else None,
    }


def process_peak_bytes() -> int | None:
    """This process's peak resident set (``VmHWM`` of /proc/self/status), or None where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        return None
    return None


def job_object(record: JobRecord, live: LiveProgress | None, queue_position: int | None) -> dict[str, Any]:
    """The job object of the API (OpenAI's video object, or its image twin), with the ``layerstream`` extension."""
    if live is None:
        live = LiveProgress.from_figures(record.figures) if record.figures else LiveProgress()
    body: dict[str, Any] = {
        "id": record.id,
        "object": record.kind,
        "status": str(record.status),
        "progress": record.progress,
        "created_at": record.created_at,
        "completed_at": record.completed_at,
        "size": record.settings.size,
    }
    if record.kind == "video":
        body["seconds"] = record.seconds
    running = record.status is JobStatus.IN_PROGRESS
    body |= {
        "model": record.model,
        "prompt": record.settings.prompt,
        "error": record.error,
        "inference_time_s": (record.figures or {}).get("inference_time_s"),
        "peak_memory_mb": (record.figures or {}).get("peak_memory_mb"),
        "layerstream": {
            "settings": record.settings.to_dict(),
            "queue_position": queue_position if record.status is JobStatus.QUEUED else None,
            "step": live.step if running or record.status.finished else 0,
            "total_steps": live.total_steps or record.settings.num_inference_steps,
            "seconds_per_step": live.seconds_per_step,
            "eta_seconds": live.eta_seconds if running else None,
            "streamed_bytes": live.streamed_bytes,
            "stall_seconds": live.stall_seconds,
        },
    }
    return body
