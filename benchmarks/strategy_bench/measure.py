"""Measuring helpers: host and device memory, per-block compute over forwards, link bandwidth (the block timer
and the device synchronization are `layerstream.timing.block_timer`'s, shared with the planner)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerstream.timing.block_timer import BlockTimer, synchronize


def rss_bytes() -> int:
    """Resident set size of this process (psutil where installed, else /proc)."""
    try:
        import psutil
    except ModuleNotFoundError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


def available_host_bytes() -> int | None:
    """Host memory available to new allocations, or None where it cannot be read."""
    try:
        import psutil
    except ModuleNotFoundError:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    return psutil.virtual_memory().available


class PeakRssSampler:
    """Samples the process RSS on a thread while active; `peak_bytes` is the highest value seen.

    Used around set-up only (packing, pinning, copying weights), never around timed forwards: the sampling
    thread would take the GIL from the code being timed.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRssSampler":
        self.start_bytes = self.peak_bytes = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="layerstream-bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())


class DeviceMemory:
    """Allocator readings on a CUDA device; every method answers None on other devices."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"

    def allocated(self) -> int | None:
        if not self.enabled:
            return None
        synchronize(self.device)  # frees queued on the stream land before the reading
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        if self.enabled:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        if not self.enabled:
            return None
        synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.data_ptr(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class BlockTimings:
    """Compute times of a resident model's blocks over a few forwards."""

    per_block: list[list[float]]
    """One list per block, one entry per forward (seconds)."""
    other: list[float]
    """Per forward: its time outside the blocks (embeddings, head, Python between blocks)."""

    def __add__(self, more: "BlockTimings") -> "BlockTimings":
        return BlockTimings([a + b for a, b in zip(self.per_block, more.per_block)], self.other + more.other)

    def block_medians(self) -> list[float]:
        return [statistics.median(runs) for runs in self.per_block]

    def other_median(self) -> float:
        return max(statistics.median(self.other), 0.0)


def measure_block_compute(
    forward: Callable[[], object], blocks: Sequence[nn.Module], device: torch.device, *, num_forwards: int = 5
) -> BlockTimings:
    """Time each block, and the rest of each forward, over `num_forwards` forwards of a resident model.

    Hooks add a few microseconds per block, so these forwards are not the timed ones. The time outside the
    blocks comes from the same forwards as the block times, so the two always add up to a forward.
    """
    timer = BlockTimer(blocks, device)
    totals = []
    try:
        for _ in range(num_forwards):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward()
                end.record()
                totals.append((start, end))
            else:
                begin = time.perf_counter()
                forward()
                totals.append(time.perf_counter() - begin)
        per_block = timer.seconds()  # synchronizes, so the events above are complete too
    finally:
        timer.remove()
    if device.type == "cuda":
        totals = [s.elapsed_time(e) / 1e3 for s, e in totals]
    other = [total - sum(runs[i] for runs in per_block) for i, total in enumerate(totals)]
    return BlockTimings(per_block, other)


def measure_link_gbps(device: torch.device, nbytes: int, *, num_copies: int = 5) -> float | None:
    """Host-to-device bandwidth (GB/s) of one pinned copy of `nbytes`, the median of a few; None on the CPU."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(num_copies + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dest.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()  # read this copy's time before the next starts
        times.append(start.elapsed_time(end) / 1e3)
    del host, dest
    return nbytes / statistics.median(times[1:]) / 1e9  # the first copy warms the path up
