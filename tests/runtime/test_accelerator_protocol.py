"""The accelerator engine's protocol, checked on CPU against a recording stand-in for streams and events."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from layerstream import enable_offload
from layerstream.runtime.engines.accelerator_api import AcceleratorApi
from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
from layerstream.runtime.packing.layout import BlockLayout
from runtime_toys import ToyDiT, run

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


class Recorder(AcceleratorApi):
    """Stands in for torch.cuda (overriding every call of `AcceleratorApi`): streams, events and host registration, logging every call in order. It models
    what CUDA's hazards depend on: a current device and a current stream per thread (device 0 and the compute
    stream until `device(...)` and `stream(...)` set them), the primary context each CUDA call creates on the
    calling thread's current device (`contexts`), the last error a failed call leaves on its thread until a
    launch there reads it, the streams the caching allocator must wait for before reusing a tensor's memory
    (`record_stream`), and graph capture."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []
        self._names = {}
        self._local = threading.local()
        self.contexts: set[int] = set()
        self.capturing = False
        self.refuse_registration = False
        """Make every host registration fail as CUDA does: False back, and the error kept for the thread."""
        self.refuse_unregistration = False
        """Likewise for unregistering (a buffer CUDA does not know as registered)."""
        self.errors_left: list[tuple[str, str]] = []
        """(thread name, error) of every failed call: the error stays on that thread until a launch reads it."""
        self.stream_uses: dict[int, set[str]] = {}
        """Tensor address -> the streams `record_stream` named: the allocator waits for them before reuse."""
        self.compute = self.Stream(name="compute")
        self.contexts.clear()  # building the stand-in is not a CUDA call

    @property
    def _current(self):
        return getattr(self._local, "stream", self.compute)

    def _fail(self, error: str) -> None:
        self._local.error = error
        self.errors_left.append((threading.current_thread().name, error))

    def _cuda_call(self) -> None:
        self.contexts.add(getattr(self._local, "device", 0))

    def _launch(self) -> None:
        """Compute on this thread: torch reads CUDA's last error after every kernel launch, so an error an
        earlier call left on the thread (unread) fails the launch."""
        self._cuda_call()
        sticky = getattr(self._local, "error", None)
        if sticky is not None:
            raise RuntimeError(f"CUDA error: {sticky} (left by an earlier call on this thread)")

    @contextlib.contextmanager
    def device(self, device):
        previous = getattr(self._local, "device", 0)
        self._local.device = device.index if isinstance(device, torch.device) else int(device)
        try:
            yield
        finally:
            self._local.device = previous

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def _name(self, obj, prefix):
        return self._names.setdefault(id(obj), f"{prefix}{len(self._names)}")

    def Stream(self, device=None, name=None):  # noqa: N802 - mirrors torch.cuda.Stream
        recorder = self

        class _Stream:
            def wait_event(self, event):
                recorder._cuda_call()
                recorder.log.append(("wait_event", recorder._name(self, "stream"), recorder._name(event, "event")))

            def synchronize(self):
                recorder._cuda_call()
                recorder.log.append(("synchronize", recorder._name(self, "stream")))

        stream = _Stream()
        if name:
            self._names[id(stream)] = name
        return stream

    def Event(self, enable_timing=False):  # noqa: N802 - mirrors torch.cuda.Event
        recorder = self

        class _Event:
            def record(self, stream=None):
                recorder._cuda_call()
                recorder.log.append(("record", recorder._name(self, "event"), recorder._name(stream, "stream")))

            def synchronize(self):
                recorder.log.append(("synchronize", recorder._name(self, "event")))

        return _Event()

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self._local.stream = self._current, stream
        self._cuda_call()
        self.log.append(("enter", self._name(stream, "stream")))
        try:
            yield
        finally:
            self._local.stream = previous
            self._cuda_call()  # restoring the current device's stream: a context there if there was none
            self.log.append(("exit", self._name(stream, "stream")))

    def current_stream(self, device=None):
        self._launch()  # the compute side asks for its stream to queue work on it
        return self._current

    def host_register(self, buffer):
        self._cuda_call()
        if self.refuse_registration:
            self._fail("cudaErrorHostMemoryAlreadyRegistered")
            return False
        self.log.append(("host_register", buffer.numel()))
        return True

    def host_unregister(self, buffer):
        self._cuda_call()
        if self.refuse_unregistration:
            self._fail("cudaErrorHostMemoryNotRegistered")
            return
        self.log.append(("host_unregister", buffer.numel()))

    def record_stream(self, tensor, stream):
        """`tensor.record_stream(stream)`: the caching allocator will not reuse the tensor's memory before the
        work `stream` has queued by the time the tensor is freed has run."""
        self.stream_uses.setdefault(tensor.data_ptr(), set()).add(self._name(stream, "stream"))
        self.log.append(("record_stream", tensor.data_ptr(), self._name(stream, "stream")))

    def synchronize(self, device=None):
        self.log.append(("synchronize", "device"))


def test_accelerator_engine_orders_copies_and_compute_with_events():
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    recorder = Recorder()
    engines = []

    def factory(device, num_slots):
        engine = AcceleratorCopyEngine(device, num_slots, api=recorder)
        engines.append(engine)
        return engine

    # every host buffer is requested pinned, exactly its own size
    handle = enable_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu", engine_factory=factory)
    registers = [e for e in recorder.log if e[0] == "host_register"]
    assert len(registers) == 4 and all(e[1] == host.host_bytes for e, host in zip(registers, [b.host for b in handle.streamer.blocks]))
    engine = engines[0]
    copy_stream = recorder._name(engine.copy_stream, "stream")
    ready = [recorder._name(e, "event") for e in engine._ready]
    released = [recorder._name(e, "event") for e in engine._released]

    copied_blocks = []
    real_copy_into = engine.copy_into

    def tracking_copy_into(slot, job, record=None, **options):
        copied_blocks.append((len(recorder.log), slot))
        recorder.log.append(("copy_job", slot))
        return real_copy_into(slot, job, record, **options)

    engine.copy_into = tracking_copy_into
    recorder.log.clear()
    assert torch.equal(run(model, (x,)), expected)
    recorder.log.clear()
    # steady state: a second forward
    compute_order = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: recorder.log.append(("compute", i)))
    assert torch.equal(run(model, (x,)), expected)
    log = recorder.log

    assert not [e for e in log if e[0] == "synchronize"], "no synchronize in the steady state"
    for pos, entry in enumerate(log):
        if entry[0] == "copy_job":
            slot = entry[1]
            # the copy runs on the copy stream after waiting on the slot's release event, then records ready
            window = log[pos + 1 : pos + 6]
            assert window[0] == ("enter", copy_stream)
            assert window[1] == ("wait_event", copy_stream, released[slot])
            assert ("record", ready[slot], copy_stream) in window
        if entry[0] == "compute":
            # compute waited on the ready event of the block's slot before the block ran
            waits = [e for e in log[:pos] if e[0] == "wait_event" and e[1] == "compute"]
            assert waits and waits[-1][2] in ready
            compute_order.append(entry[1])
    assert compute_order == [0, 1, 2, 3]
    # every compute release is recorded on the compute stream
    assert sum(1 for e in log if e[0] == "record" and e[1] in released and e[2] == "compute") == 4
    handle.disable()
    assert torch.equal(run(model, (x,)), expected)


def _toy_on_recorded_engine():
    """A 4-block toy DiT, its input and resident output, enabled on an accelerator engine over a `Recorder`:
    (model, x, expected, recorder, the engines made, handle)."""
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    recorder = Recorder()
    engines = []

    def factory(device, num_slots):
        engines.append(AcceleratorCopyEngine(device, num_slots, api=recorder))
        return engines[-1]

    handle = enable_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu", engine_factory=factory)
    return model, x, expected, recorder, engines, handle


def test_disable_waits_for_the_copy_stream_before_any_host_buffer_is_released():
    model, x, expected, recorder, engines, handle = _toy_on_recorded_engine()
    assert torch.equal(run(model, (x,)), expected)  # the last block prefetches the first: a copy is in flight
    recorder.log.clear()
    handle.disable()
    copy_stream = recorder._name(engines[0].copy_stream, "stream")
    log = recorder.log
    unregisters = [pos for pos, e in enumerate(log) if e[0] == "host_unregister"]
    waits = [pos for pos, e in enumerate(log) if e == ("synchronize", copy_stream)]
    assert len(unregisters) == 4, log
    assert waits and waits[0] < unregisters[0], log
    assert torch.equal(run(model, (x,)), expected)


@pytest.mark.parametrize("options", [{}, {"storage_dtype": "float8_e4m3fn"}], ids=["packed", "float8"])
def test_host_buffers_are_page_locked_on_a_pinning_thread_while_the_next_block_is_read(options):
    """Staging hands each filled buffer to the store's pinning thread and goes on reading the next block;
    enable returns only once every buffer is pinned. A registration that fails rolls the enable back."""
    import threading

    from layerstream.errors import OffloadError

    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}}

    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    recorder = Recorder()
    threads = []
    real_register = recorder.host_register

    def register(buffer):
        threads.append(threading.current_thread().name)
        return real_register(buffer)

    recorder.host_register = register
    factory = lambda device, num_slots: AcceleratorCopyEngine(device, num_slots, api=recorder)  # noqa: E731
    handle = enable_offload(model, config, device="cpu", engine_factory=factory)
    assert len(threads) == 4 and all(name.startswith("layerstream-pin") for name in threads), threads
    stats = handle.stats()
    assert stats.pinned_host_bytes == stats.host_bytes > 0
    if not options:
        assert torch.equal(run(model, (x,)), expected)
    handle.disable()
    expected = run(model, (x,))  # float8 storage rounded the weights: disable gives those values back

    failing = Recorder()
    calls = []

    def refuse_third(buffer):
        calls.append(buffer.numel())
        if len(calls) == 3:
            raise RuntimeError("cudaHostRegister failed: out of pinnable memory")
        return True

    failing.host_register = refuse_third
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    factory = lambda device, num_slots: AcceleratorCopyEngine(device, num_slots, api=failing)  # noqa: E731
    with pytest.raises((OffloadError, RuntimeError), match="out of pinnable memory"):
        enable_offload(model, config, device="cpu", engine_factory=factory)
    unregistered = [e for e in failing.log if e[0] == "host_unregister"]
    assert len(unregistered) == 3  # the pinned blocks (and only those) were unpinned
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert torch.equal(run(model, (x,)), expected)


def test_copies_and_teardown_from_a_thread_with_another_device_current_make_no_context_there():
    """An engine on device 1 driven from threads that never set a device (their current device is 0): every
    call the engine makes runs with device 1 current (its issuing and registration threads too), so no context
    appears on device 0."""
    recorder = Recorder()
    engine = AcceleratorCopyEngine(torch.device("cuda", 1), 2, api=recorder)
    recorder.contexts.clear()  # (the stand-in's constructor calls run before the guard matters)
    buffer = torch.zeros(64, dtype=torch.uint8)

    def copy_side():
        engine.copy_into(0, lambda: 0)
        engine.copy_into(1, lambda: 0, waits_on_host=True)  # queued by the issuing thread
        engine.pin_(buffer)  # registered on a thread of its own
        engine.unpin_(buffer)

    thread = threading.Thread(target=copy_side)
    thread.start()
    thread.join()
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join()
    assert recorder.contexts == {1}


def test_a_block_entered_while_the_stream_is_captured_is_refused_with_what_to_do():
    from layerstream import UnsupportedUseError

    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 16)
    recorder = Recorder()
    handle = enable_offload(
        model, {"mode": "layer", "components": ["dit"]}, device="cpu",
        engine_factory=lambda device, num_slots: AcceleratorCopyEngine(device, num_slots, api=recorder),
    )
    recorder.capturing = True
    with pytest.raises(UnsupportedUseError, match="captured into a CUDA graph.*without CUDA graphs"):
        run(model, (x,))
    recorder.capturing = False
    run(model, (x,))  # the refusal left the model usable
    handle.disable()


def test_a_refused_host_registration_leaves_buffers_pageable_and_never_fails_compute(tmp_path):
    """CUDA keeps a failed call's error for the thread until it is read, and the next launch there raises it:
    registrations run off the compute thread, so a refusal only leaves buffers pageable."""
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    recorder = Recorder()
    recorder.refuse_registration = True
    block = BlockLayout("b", model.blocks[0]).nbytes
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 2.5 * block / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(
        model, config, device="cpu",
        engine_factory=lambda device, num_slots: AcceleratorCopyEngine(device, num_slots, api=recorder),
    )
    assert handle.placement.host_tier.disk_block_paths  # the staging ring tried to register too
    assert torch.equal(run(model, (x,)), expected)
    assert handle.stats().pinned_host_bytes == 0
    handle.disable()


def test_a_refused_registration_asked_for_on_the_compute_thread_leaves_no_error_there():
    """torch's `cudaHostRegister` binding leaves CUDA's last error set on the calling thread, and the next kernel
    launched there fails with it. The engine registers (and unregisters) on a thread of its own, so a refusal
    asked for from the compute thread leaves the error on a thread that launches nothing and ends."""
    recorder = Recorder()
    recorder.refuse_registration = recorder.refuse_unregistration = True
    engine = AcceleratorCopyEngine(torch.device("cuda", 0), 2, api=recorder)
    buffer = torch.zeros(64, dtype=torch.uint8)
    assert engine.pin_(buffer) is False  # refused: the buffer stays pageable
    engine.unpin_(buffer)
    here = threading.current_thread().name
    assert [error for _, error in recorder.errors_left] == ["cudaErrorHostMemoryAlreadyRegistered", "cudaErrorHostMemoryNotRegistered"]
    assert all(thread != here and thread.startswith("layerstream-pin") for thread, _ in recorder.errors_left)
    recorder.current_stream()  # a launch on the compute thread: no error left for it to read
    engine.close()
    recorder.host_register(buffer)  # the stand-in does model the hazard: refused here, the next launch fails
    with pytest.raises(RuntimeError, match="cudaErrorHostMemoryAlreadyRegistered"):
        recorder.current_stream()


def test_the_slot_ring_is_recorded_on_the_copy_stream_before_any_copy_writes_it():
    """Slots are allocated on the compute stream; the copy stream writes them. Each is recorded on the copy
    stream at enable (`record_stream`), so the caching allocator reuses its memory only after every copy queued
    until it is freed has run, whichever way the pipeline goes (disable, or dropped without it)."""
    model, x, expected, recorder, engines, handle = _toy_on_recorded_engine()
    copy_stream = recorder._name(engines[0].copy_stream, "stream")
    slots = handle.streamer.slot_buffers
    assert len(slots) >= 2
    assert all(recorder.stream_uses.get(s.data_ptr()) == {copy_stream} for s in slots)
    assert torch.equal(run(model, (x,)), expected)
    log = recorder.log
    first_copy = log.index(("enter", copy_stream))
    assert all(pos < first_copy for pos, e in enumerate(log) if e[0] == "record_stream")
    handle.disable()
