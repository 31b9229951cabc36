"""Copy engines: the slot protocol of `runtime.contracts.CopyEngine`. `AcceleratorCopyEngine` uses a stream and
events (no CPU-side synchronize), with an issuing thread for jobs that wait on the host; `CpuCopyEngine` a copy
thread, optionally throttled to a simulated link, so that scheduling is tested and measured without a GPU.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import torch

from layerstream.errors import TransferError
from layerstream.runtime.contracts import CopyRecord, Job
from layerstream.runtime.engines.accelerator_api import AcceleratorApi
from layerstream.runtime.engines.at_exit import close_at_exit
from layerstream.runtime.packing.host_buffer import on_own_thread

logger = logging.getLogger(__name__)

MAX_COPY_RECORDS = 20_000  # copies kept for `trace()` (the newest; a long-running server must not grow without bound)


class CpuCopyEngine:
    """Copy thread with the slot protocol; `link_gbps` makes each copy last as long as it would on that link."""

    kind = "cpu-thread"

    def __init__(self, device: torch.device, num_slots: int, *, link_gbps: float | None = None):
        if link_gbps is not None and not link_gbps > 0:
            raise ValueError(f"simulated_link_gbps = {link_gbps!r} is not valid; expected a number > 0")
        self.device = device
        self.link_gbps = link_gbps
        self._ready = [_done_event() for _ in range(num_slots)]
        self._released = [_done_event() for _ in range(num_slots)]
        self._errors: list[tuple[threading.Event, BaseException] | None] = [None] * num_slots  # (copy, its error)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="layerstream-copy", daemon=True)
        self._thread.start()
        close_at_exit(self)  # its thread may be in a torch op when a script ends without disable()
        self.copies: deque[CopyRecord] = deque(maxlen=MAX_COPY_RECORDS)

    # compute side -------------------------------------------------------------------------------------------
    def copy_into(self, slot: int, job: Job, record: CopyRecord | None = None, *, waits_on_host: bool = False) -> None:
        """Queue `job` for the copy thread (every job runs there, whether or not it waits on the host)."""
        ready = threading.Event()  # one event per copy: a queued older copy can never signal a newer one
        self._ready[slot] = ready
        self._errors[slot] = None
        self._queue.put((slot, job, ready, record))

    def wait_ready(self, slot: int) -> float:
        """Block compute until the slot's copy is done; returns the seconds spent waiting (the stall)."""
        ready = self._ready[slot]
        if ready.is_set():
            stall = 0.0
        else:
            start = time.perf_counter()
            ready.wait()  # the compute thread waits for the copy thread: this is the stall being measured
            stall = time.perf_counter() - start
        failed = self._errors[slot]
        if failed is not None and failed[0] is ready:
            self._errors[slot] = None
            raise _transfer_error(slot, failed[1])
        self._released[slot].clear()  # compute now reads the slot until release()
        return stall

    def release(self, slot: int) -> None:
        self._released[slot].set()

    def now(self) -> float:
        return time.perf_counter()

    def resolve(self, mark: float) -> float:
        return mark

    def copy_records(self) -> list[CopyRecord]:
        return list(self.copies)  # the copy thread writes its times directly

    def clear_records(self) -> None:
        self.copies.clear()

    def pin_(self, buffer: torch.Tensor) -> bool:
        return False  # the CPU copies from pageable memory; there is no DMA engine to page-lock for

    def capturing(self) -> bool:
        return False  # no graphs to capture on the CPU

    def unpin_(self, buffer: torch.Tensor) -> None:
        pass

    def guard_slots_(self, slot_buffers: list[torch.Tensor]) -> None:
        pass  # a queued job holds its slot tensor: the memory cannot go before the copy into it has run

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        # every slot counts as released: nothing reads a slot after close, and a slot left held by an aborted
        # forward must not keep a queued copy (and this join) waiting
        for released in self._released:
            released.set()
        self._queue.put(None)
        # the thread finishes every queued copy before it sees the sentinel: once joined, no copy reads a host
        # buffer any more, so the caller may free them
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            logger.warning("the copy thread did not stop within 60 s; a copy job may be hanging")

    # copy side ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            slot, job, ready, record = item
            self._released[slot].wait()  # never overwrite a slot compute may still read
            start = time.perf_counter()
            try:
                nbytes = job()
                if self.link_gbps is not None:
                    target = nbytes / (self.link_gbps * 1e9)
                    remaining = target - (time.perf_counter() - start)
                    if remaining > 0:
                        time.sleep(remaining)  # the simulated link: the copy lasts as long as it would on the wire
            except BaseException as e:  # reported to compute by wait_ready, never lost in this thread
                logger.debug("copy into slot %d failed", slot, exc_info=True)
                # tagged with its copy: one superseded by a newer copy into the slot (its block forgotten while it
                # was in flight, the store being written) fails nothing, the newer copy overwrites its bytes
                self._errors[slot] = (ready, e)
            if record is not None:
                record.start, record.end = start, time.perf_counter()
                self.copies.append(record)
            ready.set()


def _done_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class _Copy:
    """One copy: `done` is set once it is queued on the copy stream (None: queued before `copy_into` returned)."""

    __slots__ = ("done", "error")

    def __init__(self, done: threading.Event | None = None):
        self.done = done
        self.error: BaseException | None = None


class AcceleratorCopyEngine:
    """Stream-and-event engine: compute never waits on the CPU for a copy, but for one not queued yet. Tests pass a
    recording `api`; `issue_thread=False` queues every copy on the caller's thread (`benchmarks/gpu_checks.py`)."""

    kind = "accelerator-streams"

    def __init__(
        self,
        device: torch.device,
        num_slots: int,
        *,
        api: AcceleratorApi | None = None,
        timing: bool = False,
        issue_thread: bool = True,
    ):
        self.device = device
        self.api = api if api is not None else _accelerator_api(device)
        self.timing = timing
        self.copy_stream = self.api.Stream(device=device)
        # one pair of events per slot, re-recorded for every copy: nothing is allocated in the steady state
        self._ready = [self.api.Event() for _ in range(num_slots)]
        self._released = [self.api.Event() for _ in range(num_slots)]
        self.copies: deque[CopyRecord] = deque(maxlen=MAX_COPY_RECORDS)
        # timing events not yet read (reading needs a synchronize, so it waits for `copy_records`): the newest
        # only, like the records, so that a traced server does not grow without bound
        self._pending_timing: deque[tuple[CopyRecord, object, object]] = deque(maxlen=MAX_COPY_RECORDS)
        self._latest = [_Copy() for _ in range(num_slots)]  # each slot's latest copy
        self._held = [False] * num_slots  # compute reads the slot (between wait_ready and release)
        self._deferred: list[tuple[Job, CopyRecord | None, bool] | None] = [None] * num_slots
        self._issue_thread = issue_thread
        self._issuer: threading.Thread | None = None  # started by the first copy that waits on the host
        self._issue_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._origin = None
        if timing:
            self._origin = self.api.Event(enable_timing=True)
            self._origin.record(self.api.current_stream(device))
        close_at_exit(self)  # its issuing thread may be in a disk read when a script ends without disable()

    def copy_into(self, slot: int, job: Job, record: CopyRecord | None = None, *, waits_on_host: bool = False) -> None:
        if self._held[slot]:
            # compute still reads this slot and has not recorded its release yet: a GPU-side wait now would wait
            # on the previous release. Queue the copy when release() records the event it must wait for
            self._deferred[slot] = (job, record, waits_on_host)
            return
        self._issue(slot, job, record, waits_on_host)

    def _on_device(self):
        """The engine's device current inside: leaving `stream(...)` in a thread with another current device creates
        a CUDA context there (0.5 GB on GPU 0 per process)."""
        return self.api.device(self.device)

    def _issue(self, slot: int, job: Job, record: CopyRecord | None, waits_on_host: bool) -> None:
        previous = self._latest[slot]
        follows = previous.done is not None and not previous.done.is_set()
        if self._issue_thread and (waits_on_host or follows):
            # the job would hold this thread until its bytes are on the host (a disk read): the issuing thread
            # queues it, and compute goes on queuing kernels meanwhile. A later copy into the same slot follows
            # it there, so that the slot's copies stay in the order they were asked for
            copy = self._latest[slot] = _Copy(threading.Event())
            self._start_issuer()
            self._issue_queue.put((slot, job, record, copy))
            return
        copy = self._latest[slot] = _Copy()
        self._queue_copy(slot, job, record, copy)

    def _start_issuer(self) -> None:
        if self._issuer is None:
            self._issuer = threading.Thread(target=self._run_issuer, name="layerstream-copy-issue", daemon=True)
            self._issuer.start()

    def _run_issuer(self) -> None:
        while (item := self._issue_queue.get()) is not None:
            slot, job, record, copy = item
            try:
                self._queue_copy(slot, job, record, copy)
            except BaseException as e:  # noqa: BLE001 - reported by wait_ready, never lost in this thread
                copy.error = copy.error or e
            finally:
                copy.done.set()

    def _queue_copy(self, slot: int, job: Job, record: CopyRecord | None, copy: _Copy) -> None:
        with self._on_device(), self.api.stream(self.copy_stream):
            # GPU-side wait: the copy may not overwrite the slot before compute has finished reading it
            self.copy_stream.wait_event(self._released[slot])
            if record is not None and self.timing:
                start, end = self.api.Event(enable_timing=True), self.api.Event(enable_timing=True)
                start.record(self.copy_stream)
            try:
                job()
            except Exception as e:  # reported by wait_ready, as the CPU engine does: one protocol everywhere
                logger.debug("copy into slot %d failed", slot, exc_info=True)
                copy.error = e
            if record is not None and self.timing:
                end.record(self.copy_stream)
                self._pending_timing.append((record, start, end))
            self._ready[slot].record(self.copy_stream)

    def wait_ready(self, slot: int) -> float:
        """Compute waits on the device; on the host (the seconds returned) only for a copy not queued yet."""
        copy = self._latest[slot]
        stall = 0.0
        if copy.done is not None and not copy.done.is_set():
            start = time.perf_counter()
            copy.done.wait()  # host-side wait: the ready event below is recorded once the copy is queued
            stall = time.perf_counter() - start
        if copy.error is not None:
            error, copy.error = copy.error, None
            raise _transfer_error(slot, error)
        # GPU-side wait: compute kernels queued after this point run only once the slot's copy has landed
        self.api.current_stream(self.device).wait_event(self._ready[slot])
        self._held[slot] = True
        return stall

    def release(self, slot: int) -> None:
        self._released[slot].record(self.api.current_stream(self.device))
        self._held[slot] = False
        deferred, self._deferred[slot] = self._deferred[slot], None
        if deferred is not None:
            self._issue(slot, *deferred)

    def capturing(self) -> bool:
        return bool(self.api.is_current_stream_capturing())

    def guard_slots_(self, slot_buffers: list[torch.Tensor]) -> None:
        """The copy stream writes these buffers compute allocated: once freed, the allocator must wait for the
        copy stream's queued work too before it hands their memory on (`record_stream`, once per slot)."""
        for buffer in slot_buffers:
            self.api.record_stream(buffer, self.copy_stream)

    def now(self):
        """A time mark on the compute stream: a timing event when tracing (read after the run), else host time."""
        if not self.timing:
            return time.perf_counter()
        event = self.api.Event(enable_timing=True)
        event.record(self.api.current_stream(self.device))
        return event

    def resolve(self, mark) -> float:
        """Seconds of a mark from `now()` (synchronizes on timing events: call after the run)."""
        if isinstance(mark, float):
            return mark
        mark.synchronize()  # reading an event's time needs it complete; this runs after the run, not in it
        return self._origin.elapsed_time(mark) / 1e3

    def pin_(self, buffer: torch.Tensor) -> bool:
        """Page-lock a host buffer in place, on a short-lived thread of its own: a refused `cudaHostRegister`
        leaves CUDA's last error set on its thread (torch neither clears nor exposes it), failing the next kernel."""
        return on_own_thread(self._register, buffer)

    def _register(self, buffer: torch.Tensor) -> bool:
        with self._on_device():
            return bool(self.api.host_register(buffer))

    def unpin_(self, buffer: torch.Tensor) -> None:
        on_own_thread(self._unregister, buffer)  # for the same reason: a teardown may run on any thread

    def _unregister(self, buffer: torch.Tensor) -> None:
        with self._on_device():  # unregistering with another device current would make a context there
            self.api.host_unregister(buffer)

    def copy_records(self) -> list[CopyRecord]:
        """Recorded copies, their timing events turned into seconds since enable. Synchronizes: call after a run."""
        while self._pending_timing:  # (the issuing thread may still add one: popped one at a time)
            record, start, end = self._pending_timing.popleft()
            record.start, record.end = self.resolve(start), self.resolve(end)
            self.copies.append(record)
        return list(self.copies)

    def clear_records(self) -> None:
        self.copies.clear()
        self._pending_timing.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for slot, deferred in enumerate(self._deferred):
            if deferred is not None:  # nothing reads a slot after close: run what waited for a release
                self._held[slot] = False
                self._deferred[slot] = None
                self._issue(slot, *deferred)
        self._stop_issuer()
        # host-side wait, once, at teardown: copies queued on the copy stream read pinned host buffers
        # asynchronously, and the last block always prefetches the first, so one is usually in flight. Only
        # after this may a host buffer be unpinned or freed, or a slot be given back to the allocator
        with self._on_device():
            self.copy_stream.synchronize()

    def _stop_issuer(self) -> None:
        """Let the issuing thread queue every copy handed to it, then stop it."""
        issuer, self._issuer = self._issuer, None
        if issuer is None:
            return
        self._issue_queue.put(None)
        if issuer is not threading.current_thread():  # (a finalizer may run on it: it stops after this job)
            issuer.join(timeout=60)
            if issuer.is_alive():
                logger.warning("the copy issuing thread did not stop within 60 s; a disk read may be hanging")


def _transfer_error(slot: int, error: BaseException) -> TransferError:
    """The error `wait_ready` raises for a failed copy job (a transfer error passes as it is)."""
    if isinstance(error, TransferError):
        return error
    wrapped = TransferError(f"copy into slot {slot} failed: {error}")
    wrapped.__cause__ = error
    return wrapped


def _accelerator_api(device: torch.device) -> AcceleratorApi:
    """torch.cuda's API, or another accelerator's torch module where it has CUDA's stream calls (`torch.xpu`)."""
    if device.type == "cuda":
        return AcceleratorApi()
    accel = getattr(torch, device.type, None)
    if accel is not None and all(hasattr(accel, name) for name in ("Stream", "Event", "stream", "current_stream", "device")):
        return AcceleratorApi(accel)
    raise ValueError(f"device {device} has no stream API; use a CUDA device or the CPU")


def make_copy_engine(device: torch.device, num_slots: int, *, link_gbps: float | None, timing: bool):
    if device.type == "cpu":
        return CpuCopyEngine(device, num_slots, link_gbps=link_gbps)
    if link_gbps is not None:
        raise ValueError(f"simulated_link_gbps applies only to the CPU; device {device} has a real link")
    return AcceleratorCopyEngine(device, num_slots, timing=timing)
