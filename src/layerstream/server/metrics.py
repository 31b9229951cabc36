"""Server metrics through `prometheus_client`, in a registry of each app's own: what the app and the worker
record as they go, and what the service holds (its queue, the runtime's counters) read when scraped."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus reads

# seconds: a tiny model answers in tens of milliseconds, a 14B video model in minutes
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# requests per pipeline call: every size up to 4 on its own (the sizes a small server runs), then coarser
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# bytes: a tiny model streams about a megabyte per request, a 14B model hundreds of gigabytes
BYTES_BUCKETS = tuple(10**k for k in range(4, 14))

JobState = Literal["queued", "in_progress", "completed", "failed"]  # OpenAI's video job statuses
JOB_STATES: tuple[str, ...] = get_args(JobState)


class JobOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    STOPPED = "stopped"  # between steps: its timeout passed, its client left, it was deleted, or a shutdown


@dataclass(frozen=True)
class QueueState:
    depth: int
    max_waiting: int
    running: bool
    num_submitted: int
    num_started: int
    num_running: int = 0  # requests in the running pipeline call (more than 1: a batch)

    @classmethod
    def of(cls, queue: Any) -> QueueState:  # a `GenerationQueue` has one of each name
        return cls(**{f.name: getattr(queue, f.name) for f in fields(cls)})


class ServerMetrics:
    """What the app records as it answers, in its own `registry`; thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def metric(kind: type, name: str, help_text: str, labels: tuple[str, ...] = (), **options: Any) -> Any:
            return kind(name, help_text, list(labels), registry=self.registry, **options)

        self._requests = metric(Counter, "layerstream_requests", "HTTP requests answered, by route and status code.",
                                ("endpoint", "status"))  # fmt: skip
        request_help = "Time from receiving a request to answering it, by route."
        self._request_seconds = metric(
            Histogram, "layerstream_request_duration_seconds", request_help, ("endpoint",), buckets=LATENCY_BUCKETS
        )
        self._queue_wait = metric(Histogram, "layerstream_queue_wait_seconds",
                                  "Time jobs waited in the queue before their work started.", buckets=LATENCY_BUCKETS)
        job_help = "Time the worker spent on a job: a job of a batch, its share (by outputs) of the batch call."
        self._job_seconds = metric(Histogram, "layerstream_job_duration_seconds", job_help, buckets=LATENCY_BUCKETS)
        self._outputs = metric(
            Counter, "layerstream_generations",
            "Outputs generated (ok), and outputs of jobs that failed (error) or were stopped (stopped).", ("outcome",),
        )  # fmt: skip
        batch_help = "Requests per pipeline call (1: run alone; more: a batch sharing every streamed block)."
        self._batch_size = metric(Histogram, "layerstream_batch_size", batch_help, buckets=BATCH_SIZE_BUCKETS)
        bytes_help = "Bytes copied host to device per request: its share, by outputs, of its batch's."
        self._request_bytes = metric(Histogram, "layerstream_request_streamed_bytes", bytes_help, buckets=BYTES_BUCKETS)
        jobs_help = "Jobs of the job API (/v1/videos, /v1/images/jobs) the server holds, by status."
        self._jobs = metric(Gauge, "layerstream_jobs", jobs_help, ("status",))
        for outcome in JobOutcome:  # every series from the start: a rate over a series that appears late is wrong
            self._outputs.labels(outcome=str(outcome))
        for state in JOB_STATES:
            self._jobs.labels(status=state)
        self._lock = threading.Lock()
        self._job_states: dict[str, str] = {}

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()
        self._request_seconds.labels(endpoint=endpoint).observe(seconds)

    def observe_job(self, *, queue_seconds: float, seconds: float | None, num_outputs: int, outcome: JobOutcome):
        """A finished job's wait, time (None: it never ran; in a batch, its share of the call) and outputs."""
        self._queue_wait.observe(queue_seconds)
        if seconds is not None:
            self._job_seconds.observe(seconds)
        self._outputs.labels(outcome=str(outcome)).inc(num_outputs)

    def observe_batch(self, num_requests: int) -> None:
        self._batch_size.observe(num_requests)

    def observe_request_bytes(self, num_bytes: int) -> None:
        self._request_bytes.observe(num_bytes)

    def record_job_state(self, job_id: str, status: str) -> None:
        """Job `job_id` is now in `status`: it moves between the series of ``layerstream_jobs``."""
        if status not in JOB_STATES:
            raise ValueError(f"status = {status!r}: expected one of {', '.join(JOB_STATES)}")
        with self._lock:  # the previous state and the gauges change together
            previous = self._job_states.get(job_id)
            self._job_states[job_id] = status
            if previous is not None:
                self._jobs.labels(status=previous).dec()
            self._jobs.labels(status=status).inc()

    def forget_job(self, job_id: str) -> None:
        """Job `job_id` was deleted (or dropped by retention): it leaves ``layerstream_jobs``."""
        with self._lock:
            previous = self._job_states.pop(job_id, None)
            if previous is not None:
                self._jobs.labels(status=previous).dec()

    def render(self, *, queue: QueueState, offload: Any | None, labels: Mapping[str, str]) -> str:
        """The exposition text: what was recorded, then the service's state now (`offload`: an `OffloadStats`)."""
        families = [
            InfoMetricFamily("layerstream_server", "The served model and device (value always 1).", value=dict(labels)),
            CounterMetricFamily("layerstream_jobs_submitted", "Requests queued.", value=queue.num_submitted),
            CounterMetricFamily("layerstream_jobs_started", "Queued requests whose work started.",
                                value=queue.num_started),
            GaugeMetricFamily("layerstream_queue_depth", "Requests waiting behind the running one.", value=queue.depth),
            GaugeMetricFamily("layerstream_queue_capacity", "Most requests that may wait.", value=queue.max_waiting),
            GaugeMetricFamily("layerstream_generation_running", "1 while a generation runs.", value=int(queue.running)),
            GaugeMetricFamily("layerstream_batch_running", "Requests in the running pipeline call.",
                              value=queue.num_running),
        ]
        for name, kind, attr, help_text in _OFFLOAD_METRICS if offload is not None else ():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families.append(family(name, help_text, value=getattr(offload, attr, 0)))
        return render_families(families, registry=self.registry)


def render_families(families: Iterable[Metric], *, registry: CollectorRegistry | None = None) -> str:
    """`families` (and what `registry` holds, first) in the text format."""
    return generate_latest(_Scrape(registry, list(families))).decode("utf-8")


class _Scrape:

    def __init__(self, registry: CollectorRegistry | None, families: list[Metric]):
        self.registry = registry
        self.families = families

    def collect(self) -> Iterator[Metric]:
        if self.registry is not None:
            for metric in self.registry.collect():  # made afresh by each collect: ours to trim
                # the creation times of counters and histograms: the 0.0.4 text format has no place for them and
                # would serve each as a gauge family of its own
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
                yield metric
        yield from self.families


# name (without _total for counters), type, OffloadStats attribute, help
_OFFLOAD_METRICS = (
    ("layerstream_streamed_bytes", "counter", "bytes_transferred", "Bytes copied host to device by offload."),
    ("layerstream_transfers", "counter", "num_transfers", "Block (or module) copies issued."),
    ("layerstream_sync_loads", "counter", "num_sync_loads", "Blocks loaded synchronously (not prefetched)."),
    ("layerstream_stall_seconds", "counter", "stall_seconds", "Time compute waited for weight copies."),
    ("layerstream_device_bytes", "gauge", "device_bytes", "Device bytes held: resident tensors plus the slot ring."),
    ("layerstream_host_bytes", "gauge", "host_bytes", "Host bytes held by the store of streamed blocks."),
    ("layerstream_pinned_host_bytes", "gauge", "pinned_host_bytes", "Pinned part of the host store."),
    ("layerstream_slot_bytes", "gauge", "slot_bytes", "Bytes of the device slot ring."),
    ("layerstream_disk_read_bytes", "counter", "disk_bytes_read", "Bytes the disk tier read (host_budget_gb)."),
    ("layerstream_disk_stall_seconds", "counter", "disk_stall_seconds", "Time compute waited on disk-tier reads."),
    ("layerstream_host_pool_bytes", "gauge", "host_pool_bytes", "Host pool shared by alternating DiTs (in host bytes)."),
    ("layerstream_disk_staging_bytes", "gauge", "disk_staging_bytes", "Staging ring of the disk tier (beyond the budget)."),
    ("layerstream_max_materialized_blocks", "gauge", "max_materialized_blocks", "Most blocks bound to slots at once."),
)  # fmt: skip
