"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Request counters and latency histograms are kept here; the offload runtime's counters (bytes streamed,
stall time, device and host bytes) come from a snapshot of `Omni.stats()` passed to `render`.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds: a tiny model answers in tens of milliseconds, a 14B video model in minutes
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# requests per pipeline call: every size up to 4 on its own (the sizes a small server runs), then coarser
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# bytes: a tiny model streams about a megabyte per request, a 14B model hundreds of gigabytes
BYTES_BUCKETS = tuple(10**k for k in range(4, 14))


class Histogram:
    """Cumulative-bucket histogram of one label set."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)  # le: a value equal to a bound falls in that bucket
        if index < len(self.buckets):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def samples(self, name: str, labels: Mapping[str, str]) -> list[str]:
        lines = []
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(_sample(f"{name}_bucket", {**labels, "le": _number(bound)}, cumulative))
        lines.append(_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, self.count))
        lines.append(_sample(f"{name}_sum", labels, self.total))
        lines.append(_sample(f"{name}_count", labels, self.count))
        return lines


class JobOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    STOPPED = "stopped"
    """Stopped between steps: its timeout passed, its client left, or the server shut down."""


@dataclass(frozen=True)
class QueueState:
    depth: int
    max_waiting: int
    running: bool
    num_submitted: int
    num_started: int
    num_running: int = 0
    """Requests in the running pipeline call (more than 1: a batch)."""


class ServerMetrics:
    """Counters the app updates as it answers; thread-safe (the worker thread reports generations)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, Histogram] = {}
        self._queue_wait = Histogram()
        self._generation_seconds = Histogram()
        self._generations: dict[str, int] = {}
        self._batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self._request_bytes = Histogram(BYTES_BUCKETS)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1
            self._latency.setdefault(endpoint, Histogram()).observe(seconds)

    def observe_job(self, *, queue_seconds: float, seconds: float, num_outputs: int, outcome: JobOutcome) -> None:
        """One job the worker ran: its wait, its generation time and how many outputs it asked for."""
        with self._lock:
            self._queue_wait.observe(queue_seconds)
            self._generation_seconds.observe(seconds)
            self._generations[outcome] = self._generations.get(outcome, 0) + num_outputs

    def observe_batch(self, num_requests: int) -> None:
        """One pipeline call the worker made, for `num_requests` requests (1: a request run alone)."""
        with self._lock:
            self._batch_size.observe(num_requests)

    def observe_request_bytes(self, num_bytes: int) -> None:
        """Bytes streamed for one request: its share, by outputs, of what its batch streamed."""
        with self._lock:
            self._request_bytes.observe(num_bytes)

    def render(self, *, queue: QueueState, offload: Any | None, labels: Mapping[str, str]) -> str:
        """The exposition text. `offload` is an `OffloadStats` snapshot (or None); `labels` go on the info metric."""
        with self._lock:  # copy under the lock, format outside it
            requests = sorted(self._requests.items())
            latency = sorted((endpoint, _copy(h)) for endpoint, h in self._latency.items())
            queue_wait = _copy(self._queue_wait)
            generation_seconds = _copy(self._generation_seconds)
            generations = dict(self._generations)
            batch_size = _copy(self._batch_size)
            request_bytes = _copy(self._request_bytes)
        text = _Exposition()
        text.family("layerstream_server_info", "gauge", "The served model and device (value always 1).", [(labels, 1)])
        text.family(
            "layerstream_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status code.",
            [({"endpoint": endpoint, "status": status}, n) for (endpoint, status), n in requests],
        )
        text.histograms(
            "layerstream_request_duration_seconds",
            "Time from receiving a request to answering it, by endpoint.",
            [({"endpoint": endpoint}, h) for endpoint, h in latency],
        )
        text.histograms("layerstream_queue_wait_seconds", "Time jobs waited in the queue.", [({}, queue_wait)])
        text.histograms(
            "layerstream_generation_duration_seconds", "Time the worker spent on a job.", [({}, generation_seconds)]
        )
        text.family(
            "layerstream_generations_total",
            "counter",
            "Outputs generated (ok), and outputs of jobs that failed (error) or were stopped (stopped).",
            [({"outcome": str(outcome)}, generations.get(outcome, 0)) for outcome in JobOutcome],
        )
        text.histograms(
            "layerstream_batch_size",
            "Requests per pipeline call (1: run alone; more: a batch sharing every streamed block).",
            [({}, batch_size)],
        )
        text.histograms(
            "layerstream_request_bytes_streamed",
            "Bytes copied host to device per request: its share, by outputs, of its batch's.",
            [({}, request_bytes)],
        )
        text.scalar("layerstream_jobs_submitted_total", "counter", "Requests queued.", queue.num_submitted)
        text.scalar("layerstream_jobs_started_total", "counter", "Queued requests whose work started.", queue.num_started)
        text.scalar("layerstream_queue_depth", "gauge", "Requests waiting behind the running one.", queue.depth)
        text.scalar("layerstream_queue_capacity", "gauge", "Most requests that may wait.", queue.max_waiting)
        text.scalar("layerstream_generation_running", "gauge", "1 while a generation runs.", int(queue.running))
        text.scalar("layerstream_batch_running", "gauge", "Requests in the running pipeline call.", queue.num_running)
        if offload is not None:
            for name, kind, attr, help_text in _OFFLOAD_METRICS:
                text.scalar(name, kind, help_text, getattr(offload, attr, 0))
        return text.render()


# name, type, OffloadStats attribute, help
_OFFLOAD_METRICS = (
    ("layerstream_bytes_streamed_total", "counter", "bytes_transferred", "Bytes copied host to device by offload."),
    ("layerstream_transfers_total", "counter", "num_transfers", "Block (or module) copies issued."),
    ("layerstream_sync_loads_total", "counter", "num_sync_loads", "Blocks loaded synchronously (not prefetched)."),
    ("layerstream_stall_seconds_total", "counter", "stall_seconds", "Time compute waited for weight copies."),
    ("layerstream_device_bytes", "gauge", "device_bytes", "Device bytes held: resident tensors plus the slot ring."),
    ("layerstream_host_bytes", "gauge", "host_bytes", "Host bytes held by the store of streamed blocks."),
    ("layerstream_pinned_host_bytes", "gauge", "pinned_host_bytes", "Pinned part of the host store."),
    ("layerstream_slot_bytes", "gauge", "slot_bytes", "Bytes of the device slot ring."),
    ("layerstream_disk_bytes_read_total", "counter", "disk_bytes_read", "Bytes the disk tier read (host_budget_gb)."),
    ("layerstream_disk_stall_seconds_total", "counter", "disk_stall_seconds", "Time compute waited on disk-tier reads."),
    ("layerstream_host_pool_bytes", "gauge", "host_pool_bytes", "Host pool shared by alternating DiTs (in host bytes)."),
    ("layerstream_disk_staging_bytes", "gauge", "disk_staging_bytes", "Staging ring of the disk tier (beyond the budget)."),
    ("layerstream_max_materialized_blocks", "gauge", "max_materialized_blocks", "Most blocks bound to slots at once."),
)


class _Exposition:
    """Lines of the text format, one metric family at a time (HELP, TYPE, then its samples)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> None:
        self._header(name, kind, help_text)
        self.lines.extend(_sample(name, labels, value) for labels, value in samples)

    def scalar(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [({}, value)])

    def histograms(self, name: str, help_text: str, series: Iterable[tuple[Mapping[str, str], Histogram]]) -> None:
        self._header(name, "histogram", help_text)
        for labels, histogram in series:
            self.lines.extend(histogram.samples(name, labels))

    def render(self) -> str:
        return "\n".join(self.lines) + "\n"

    def _header(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {_number(value)}"
    return f"{name} {_number(value)}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _copy(histogram: Histogram) -> Histogram:
    copy = Histogram(histogram.buckets)
    copy.counts = list(histogram.counts)
    copy.total = histogram.total
    copy.count = histogram.count
    return copy
