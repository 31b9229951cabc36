"""The `CopyEngine` contract, run against every implementation: the CPU copy thread, and the accelerator
engine on the recording stand-in for torch.cuda (where the contract is visible as the order of stream and
event calls, read with CUDA's semantics: a stream's `wait_event` waits for the event's latest `record` made
before the wait, never for a later one)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from layerstream import LayerstreamError, TransferError
from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine, CpuCopyEngine
from layerstream.runtime.contracts import CopyEngine
from test_accelerator_protocol import Recorder

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
ENGINES = ["cpu-thread", "accelerator-recorder", "accelerator-issuing"]
QUIET_S = 0.15  # how long a copy that must not run yet is given to run anyway


class IssuingEngine(AcceleratorCopyEngine):
    """The accelerator engine with every job taken as one that waits on the host (a disk read): each is queued
    by the engine's issuing thread."""

    def copy_into(self, slot, job, record=None, *, waits_on_host=True):
        super().copy_into(slot, job, record, waits_on_host=True)


def make_engine(kind: str, num_slots: int = 2):
    if kind == "cpu-thread":
        return CpuCopyEngine(CPU, num_slots)
    if kind == "accelerator-issuing":
        return IssuingEngine(CPU, num_slots, api=Recorder())
    return AcceleratorCopyEngine(CPU, num_slots, api=Recorder())


class Jobs:
    """Copy jobs that record when they ran (and, on the recorder, where in its call log)."""

    def __init__(self, engine):
        self.engine = engine
        self.ran: dict[str, float] = {}
        self.log_pos: dict[str, int] = {}
        self.events: dict[str, threading.Event] = {}
        self.threads: dict[str, str] = {}
        self.gate_open: dict[str, bool] = {}

    def job(self, name: str, nbytes: int = 8, fail: BaseException | None = None, seconds: float = 0.0):
        self.events[name] = threading.Event()

        def run() -> int:
            if seconds:
                time.sleep(seconds)
            self.ran[name] = time.perf_counter()
            self.threads[name] = threading.current_thread().name
            api = getattr(self.engine, "api", None)
            if isinstance(api, Recorder):
                self.log_pos[name] = len(api.log)
                api.log.append(("job", name))
            self.events[name].set()
            if fail is not None:
                raise fail
            return nbytes

        return run


def _names(engine):
    api = engine.api
    return (
        api._name(engine.copy_stream, "stream"),
        [api._name(e, "event") for e in engine._ready],
        [api._name(e, "event") for e in engine._released],
    )


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_implements_the_protocol(kind):
    engine = make_engine(kind)
    assert isinstance(engine, CopyEngine) and engine.kind
    engine.close()


# --- a copy into a slot that compute holds waits for its release ---------------------------------------------


def test_cpu_copy_into_a_held_slot_runs_only_after_release():
    engine = make_engine("cpu-thread")
    jobs = Jobs(engine)
    engine.copy_into(0, jobs.job("first"))
    engine.wait_ready(0)  # compute now reads slot 0
    engine.copy_into(0, jobs.job("second"))
    assert not jobs.events["second"].wait(QUIET_S), "the copy overwrote a slot compute still holds"
    released_at = time.perf_counter()
    engine.release(0)
    engine.wait_ready(0)  # the new copy's readiness, not the old one's
    assert jobs.ran["second"] >= released_at
    engine.release(0)
    engine.close()


def test_accelerator_copy_into_a_released_slot_waits_for_that_release_on_the_copy_stream():
    engine = make_engine("accelerator-recorder")
    log, jobs = engine.api.log, Jobs(engine)
    copy_stream, ready, released = _names(engine)
    engine.copy_into(0, jobs.job("first"))
    engine.wait_ready(0)
    engine.release(0)
    release_pos = max(i for i, e in enumerate(log) if e == ("record", released[0], "compute"))
    engine.copy_into(0, jobs.job("second"))
    waits = [i for i, e in enumerate(log) if e == ("wait_event", copy_stream, released[0])]
    # the copy stream waits on slot 0's release event, recorded before that wait, before the job is queued ...
    assert waits and release_pos < waits[-1] < jobs.log_pos["second"]
    # ... inside the copy stream's context, and marks the slot ready on the copy stream afterwards
    enters = [i for i, e in enumerate(log) if e == ("enter", copy_stream) and i < waits[-1]]
    assert enters and ("exit", copy_stream) not in log[enters[-1] : jobs.log_pos["second"]]
    assert ("record", ready[0], copy_stream) in log[jobs.log_pos["second"] :]
    engine.close()


def test_accelerator_copy_into_a_held_slot_waits_for_the_coming_release():
    engine = make_engine("accelerator-recorder")
    log, jobs = engine.api.log, Jobs(engine)
    copy_stream, _, released = _names(engine)
    engine.copy_into(0, jobs.job("first"))
    engine.wait_ready(0)  # compute now reads slot 0
    engine.copy_into(0, jobs.job("second"))
    engine.release(0)
    release_pos = max(i for i, e in enumerate(log) if e == ("record", released[0], "compute"))
    waits = [i for i, e in enumerate(log) if e == ("wait_event", copy_stream, released[0])]
    # with CUDA semantics, the copy of "second" is ordered after compute's release only if the copy stream's
    # wait on the release event was issued after that release was recorded, and the copy after that wait
    assert any(release_pos < w < jobs.log_pos["second"] for w in waits), log
    engine.close()


# --- a failing copy job surfaces as TransferError from wait_ready; the slot is usable again ------------------


@pytest.mark.parametrize("kind", ENGINES)
def test_a_failing_copy_job_surfaces_from_wait_ready_and_the_slot_recovers(kind):
    engine = make_engine(kind)
    jobs = Jobs(engine)
    cause = OSError("injected: the host buffer could not be read")
    engine.copy_into(0, jobs.job("bad", fail=cause))
    engine.copy_into(1, jobs.job("good-1"))
    with pytest.raises(TransferError) as raised:
        engine.wait_ready(0)
    assert isinstance(raised.value, LayerstreamError) and raised.value.__cause__ is cause
    assert "slot 0" in str(raised.value)
    engine.wait_ready(1)  # the other slot is not affected
    engine.release(1)
    # the failed slot takes the next copy and is ready once it lands; the error is reported once only
    engine.copy_into(0, jobs.job("retry"))
    engine.wait_ready(0)
    assert "retry" in jobs.ran
    engine.release(0)
    engine.copy_into(0, jobs.job("again"))
    engine.wait_ready(0)
    engine.release(0)
    engine.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_transfer_error_from_a_job_passes_through_as_itself(kind):
    engine = make_engine(kind)
    error = TransferError("injected: a peer rank is gone")
    engine.copy_into(1, Jobs(engine).job("bad", fail=error))
    with pytest.raises(TransferError) as raised:
        engine.wait_ready(1)
    assert raised.value is error
    engine.close()


# --- close() waits for every queued copy ---------------------------------------------------------------------


def test_cpu_close_waits_for_every_queued_copy():
    engine = make_engine("cpu-thread", num_slots=3)
    jobs = Jobs(engine)
    for i, slot in enumerate([0, 1, 2, 0]):
        engine.copy_into(slot, jobs.job(f"copy-{i}", seconds=0.03))
    engine.close()
    assert set(jobs.ran) == {f"copy-{i}" for i in range(4)}  # every copy finished before close returned
    engine.close()  # a second close is a no-op


def test_cpu_close_does_not_hang_on_a_slot_left_held_and_still_runs_its_copy():
    engine = make_engine("cpu-thread")
    jobs = Jobs(engine)
    engine.copy_into(0, jobs.job("first"))
    engine.wait_ready(0)  # held, never released (an aborted forward)
    engine.copy_into(0, jobs.job("queued"))
    done = threading.Event()
    closer = threading.Thread(target=lambda: (engine.close(), done.set()), daemon=True)
    closer.start()
    assert done.wait(5), "close() hung on a slot compute never released"
    assert "queued" in jobs.ran


def test_accelerator_close_synchronizes_the_copy_stream_once():
    engine = make_engine("accelerator-recorder")
    jobs = Jobs(engine)
    copy_stream, _, _ = _names(engine)
    engine.copy_into(0, jobs.job("in-flight"))
    engine.close()
    engine.close()
    log = engine.api.log
    syncs = [i for i, e in enumerate(log) if e == ("synchronize", copy_stream)]
    assert len(syncs) == 1 and syncs[0] > jobs.log_pos["in-flight"]


# --- a job that waits on the host is queued by the accelerator engine's issuing thread --------------------------


def _gated(jobs: Jobs, name: str, gate: threading.Event):
    """A job that waits (at most 5 s) for the test to open `gate`, as a disk job waits for its read."""
    inner = jobs.job(name)

    def run() -> int:
        jobs.gate_open[name] = gate.wait(5)
        return inner()

    return run


def test_accelerator_a_job_that_waits_on_the_host_leaves_the_compute_thread_free_and_wait_ready_waits_for_it():
    engine = make_engine("accelerator-recorder")
    log, jobs = engine.api.log, Jobs(engine)
    _, ready, _ = _names(engine)
    gate = threading.Event()
    engine.copy_into(0, _gated(jobs, "disk", gate), waits_on_host=True)
    # copy_into returned with the job still waiting: it did not run here (inline, it would have timed out)
    assert "disk" not in jobs.ran
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    stall = engine.wait_ready(0)  # the compute thread waits on the host only now, for the job to be queued
    opener.join()
    assert jobs.gate_open["disk"] and jobs.threads["disk"] == "layerstream-copy-issue"
    assert stall > 0
    # compute's device-side wait on the slot's ready event comes after the issuing thread recorded it
    recorded = max(i for i, e in enumerate(log) if e[0] == "record" and e[1] == ready[0] and e[2] != "compute")
    waited = max(i for i, e in enumerate(log) if e == ("wait_event", "compute", ready[0]))
    assert jobs.log_pos["disk"] < recorded < waited
    engine.release(0)
    engine.close()
    assert not [t for t in threading.enumerate() if t.name == "layerstream-copy-issue"]


def test_accelerator_a_copy_into_a_slot_whose_disk_copy_is_pending_follows_it_on_the_issuing_thread():
    """One order per slot: a copy that would run on the compute thread waits behind the slot's pending one."""
    engine = make_engine("accelerator-recorder")
    jobs = Jobs(engine)
    gate = threading.Event()
    engine.copy_into(0, _gated(jobs, "disk", gate), waits_on_host=True)
    engine.copy_into(0, jobs.job("host"))  # the slot was taken for another block before the first was used
    engine.copy_into(1, jobs.job("other-slot"))  # another slot: queued right here
    assert jobs.threads["other-slot"] == threading.current_thread().name and "host" not in jobs.ran
    gate.set()
    engine.wait_ready(0)
    assert jobs.ran["disk"] < jobs.ran["host"] and jobs.threads["host"] == "layerstream-copy-issue"
    engine.release(0)
    engine.wait_ready(1)
    engine.release(1)
    engine.close()


def test_accelerator_close_lets_the_issuing_thread_queue_its_copies_then_synchronizes():
    engine = make_engine("accelerator-issuing")
    jobs = Jobs(engine)
    copy_stream, _, _ = _names(engine)
    engine.copy_into(0, jobs.job("slow", seconds=0.05))
    engine.copy_into(1, jobs.job("next"))
    engine.close()
    log = engine.api.log
    syncs = [i for i, e in enumerate(log) if e == ("synchronize", copy_stream)]
    assert set(jobs.ran) == {"slow", "next"} and len(syncs) == 1 and syncs[0] > jobs.log_pos["next"]
    assert not [t for t in threading.enumerate() if t.name == "layerstream-copy-issue"]
