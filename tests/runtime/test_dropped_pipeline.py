"""A pipeline dropped without `disable()` releases everything enable took: the copy thread stops (after its
copies in flight), host memory goes back, spill files are removed. Five enable-and-drop cycles leave no
layerstream thread running and the process's memory within one slot ring of where it started."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import torch

from layerstream import enable_offload
from layerstream.runtime.packing.host_memory import release_freed_memory
from layerstream.runtime.packing.layout import BlockLayout
from tests.runtime.runtime_toys import ToyDiT, make_my_pipeline, run, toy_inputs

DIM = 512


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _layerstream_threads(started_after: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """Names of layerstream's live threads, leaving out those already alive in `started_after` (another test's
    pipeline, still alive on this worker, is not this test's to stop)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("layerstream") and t not in started_after]


def _enable_run_and_drop(config: dict) -> tuple[int, int]:
    """One cycle; returns (the host bytes the store held: what a leak would keep, the slot ring's bytes)."""
    pipe = make_my_pipeline(dim=DIM)
    pipe.transformer = ToyDiT(dim=DIM, num_blocks=6)
    handle = enable_offload(pipe, config, device="cpu")
    ids, x = toy_inputs(dim=DIM)
    with torch.no_grad():
        run(pipe, (ids, x))  # the last block prefetches the first: a copy is in flight when the pipeline goes
    host_bytes = handle.stats().host_bytes
    ring = handle.stats().slot_bytes
    del pipe, handle
    gc.collect()
    return host_bytes, ring


def test_five_dropped_pipelines_leave_no_thread_and_no_host_memory():
    _enable_run_and_drop({"mode": "layer", "components": ["dit"]})  # warm-up: imports and the allocator's pools
    gc.collect()
    release_freed_memory()
    threads_before = _layerstream_threads()
    rss_before = _rss_bytes()
    held = []
    for _ in range(5):
        held.append(_enable_run_and_drop({"mode": "layer", "components": ["dit"]}))
    gc.collect()
    release_freed_memory()
    assert _layerstream_threads() == threads_before
    host_bytes, ring = held[0]
    assert host_bytes > 10 * 2**20  # enough that five leaked stores would show
    grown = _rss_bytes() - rss_before
    assert grown < ring + 8 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB over 5 cycles of {host_bytes / 2**20:.0f} MiB stores"


def test_a_dropped_disk_tier_pipeline_removes_its_spill_files(tmp_path):
    alive_before = frozenset(threading.enumerate())
    pipe = make_my_pipeline(dim=64)
    block = BlockLayout("b", pipe.transformer.blocks[0]).nbytes
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 1.5 * block / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(pipe, config, device="cpu")
    assert list(tmp_path.rglob("*.block"))
    del pipe, handle
    gc.collect()
    assert list(tmp_path.rglob("*.block")) == [] and not any(tmp_path.iterdir())
    assert not [n for n in _layerstream_threads(alive_before) if n.startswith("layerstream-copy")]


def test_a_kept_handle_keeps_the_pipeline_working_and_disable_still_restores():
    pipe = make_my_pipeline()
    inputs = toy_inputs()
    expected = run(pipe, inputs)
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
    transformer = pipe.transformer
    del pipe
    gc.collect()  # the handle keeps the pipeline: nothing is released under it
    with torch.no_grad():
        assert torch.equal(run(handle._pipeline, inputs), expected)
    handle.disable()
    assert all(p.numel() > 0 for p in transformer.parameters())


def test_a_dropped_pipeline_on_the_accelerator_engine_stops_its_issuing_thread_and_unregisters_everything(tmp_path):
    alive_before = frozenset(threading.enumerate())
    """The accelerator engine (its CUDA calls recorded by a stand-in) with the disk tier: the issuing thread that
    queued the disk blocks' copies stops, after the copy stream is synchronized every registered buffer is
    unregistered, and the spill files go."""
    from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
    from test_accelerator_protocol import Recorder

    pipe = make_my_pipeline(dim=64)
    block = BlockLayout("b", pipe.transformer.blocks[0]).nbytes
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 1.5 * block / 1e9, "disk_dir": str(tmp_path)}
    recorder = Recorder()
    handle = enable_offload(
        pipe, config, device="cpu", engine_factory=lambda device, n: AcceleratorCopyEngine(device, n, api=recorder)
    )
    copy_stream = recorder._name(handle.backend._engine.copy_stream, "stream")
    ids, x = toy_inputs(dim=64)
    with torch.no_grad():
        run(pipe, (ids, x))
    assert "layerstream-copy-issue" in _layerstream_threads(alive_before)  # disk blocks' copies went through it
    registered = sum(1 for e in recorder.log if e[0] == "host_register")
    recorder.log.clear()
    del pipe, handle
    gc.collect()
    log = recorder.log
    unregistered = [pos for pos, e in enumerate(log) if e[0] == "host_unregister"]
    synced = log.index(("synchronize", copy_stream))
    assert registered > 0 and len(unregistered) == registered and all(pos > synced for pos in unregistered)
    assert not [
        n for n in _layerstream_threads(alive_before) if n.startswith(("layerstream-copy", "layerstream-disk", "layerstream-pin"))
    ]
    assert list(tmp_path.rglob("*.block")) == []
