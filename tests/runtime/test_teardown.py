"""Teardown: after `disable()` nothing reachable from a kept handle holds the slot ring or the host store, and
50 enable/disable cycles in one process, keeping every handle, grow host memory by less than one slot ring."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from layerstream import enable_offload
from runtime_toys import ToyDiT, run

DIT = {"mode": "layer", "components": ["dit"]}
NUM_CYCLES = 50
DIM = 256  # one ToyBlock: 4 * DIM**2 + a few vectors of float32, about 1 MiB: one slot ring is about 2 MiB


def _malloc_trim():
    """glibc's `malloc_trim`, or None: it hands freed heap pages back to the OS, so that RSS counts live memory
    rather than what the allocator keeps cached (without it RSS wanders by a few MiB from cycle to cycle)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def _rss_bytes() -> int:
    """Resident host memory of this process, after a full collection and a trim of the allocator's free pages."""
    gc.collect()
    MALLOC_TRIM(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _ring_and_store_refs(handle) -> list[StorageWeakRef]:
    """Weak references to the storage of every slot buffer and every host buffer of the handle's store."""
    streamer = handle.streamer
    refs = [StorageWeakRef(buf.untyped_storage()) for buf in streamer.slot_buffers]
    refs += [StorageWeakRef(block.host.buffer.untyped_storage()) for block in streamer.blocks]
    return refs


def _make_model():
    torch.manual_seed(0)
    return ToyDiT(dim=DIM, num_blocks=4).eval()


def test_disable_leaves_nothing_holding_the_slot_ring_or_the_host_buffers():
    model = _make_model()
    x = torch.randn(1, 2, DIM)
    expected = run(model, (x,))
    handle = enable_offload(model, DIT, device="cpu")
    assert torch.equal(run(model, (x,)), expected)  # views of every slot are built and cached
    assert torch.equal(run(model, (x,)), expected)
    streamer = handle.streamer
    assert all(block.views for block in streamer.blocks)
    refs = _ring_and_store_refs(handle)
    assert len(refs) == handle.stats().num_slots + 4
    del streamer
    handle.disable()
    gc.collect()
    assert handle.streamer is None and handle.backend is None and not handle.enabled
    alive = [i for i, ref in enumerate(refs) if not ref.expired()]
    assert alive == [], f"storages still referenced after disable: {alive} (slots first, then host buffers)"
    # the kept handle still answers, with the figures of the moment it was disabled
    assert handle.stats().num_slots == 2 and handle.trace().intervals == ()
    assert torch.equal(run(model, (x,)), expected)


@pytest.mark.skipif(MALLOC_TRIM is None, reason="needs Linux (VmRSS) and glibc (malloc_trim) to measure host memory")
def test_fifty_enable_disable_cycles_grow_host_memory_by_less_than_one_slot_ring():
    model = _make_model()
    x = torch.randn(1, 2, DIM)
    expected = run(model, (x,))
    handles, refs = [], []

    def cycle() -> None:
        handle = enable_offload(model, DIT, device="cpu")
        assert torch.equal(run(model, (x,)), expected)  # the ring is used: views cached, a copy left in flight
        refs.extend(_ring_and_store_refs(handle))
        handle.disable()
        handles.append(handle)  # every handle is kept

    for _ in range(3):  # the first cycles warm up what any first use does (the copy thread, kernels' caches)
        cycle()
    ring_bytes = handles[0].stats().slot_bytes
    assert ring_bytes > 2 * 2**20  # two slots of a block of just over 1 MiB
    before = _rss_bytes()
    for _ in range(NUM_CYCLES):
        cycle()
    grown = _rss_bytes() - before
    assert grown < ring_bytes, f"host memory grew by {grown} bytes over {NUM_CYCLES} cycles; one ring is {ring_bytes}"
    assert len(handles) == NUM_CYCLES + 3 and not any(h.enabled for h in handles)
    alive = sum(not ref.expired() for ref in refs)
    assert alive == 0, f"{alive} of {len(refs)} slot and host buffers outlive their disabled handles"
    assert torch.equal(run(model, (x,)), expected)
