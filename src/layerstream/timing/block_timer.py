"""Per-block compute times from forward hooks, and the device synchronization that bounds a timed interval."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn


def synchronize(device: torch.device) -> None:
    """Wait for the device to finish queued work (a no-op on the CPU, where work is already done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timing boundary: every queued kernel and copy counts in the interval


class BlockTimer:
    """Forward hooks that time each block: perf_counter on the CPU, CUDA events on a GPU (no host sync inside)."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device):
        self.device = device
        self.marks: list[list] = [[] for _ in blocks]  # per block: (start, end) pairs of the current forward
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._mark(i, start=True)))
            self.handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._mark(i, start=False)))

    def _mark(self, index: int, *, start: bool) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        if start:
            self.marks[index].append([event, None])
        else:
            self.marks[index][-1][1] = event

    def seconds(self) -> list[list[float]]:
        """Per block, the duration of each recorded run."""
        synchronize(self.device)  # event times can be read only once they have completed
        out = []
        for pairs in self.marks:
            if self.device.type == "cuda":
                out.append([s.elapsed_time(e) / 1e3 for s, e in pairs])
            else:
                out.append([e - s for s, e in pairs])
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
