"""The naive baseline: load each block synchronously right before its forward, drop it right after.

Nothing overlaps: every byte of every block crosses the link while compute waits, one tensor at a time, which
is what offloading without a copy stream (and without prefetch) costs. On the CPU the copy is a memcpy and the
simulated link is honoured by sleeping until the copy has lasted `nbytes / bandwidth`, as the CPU copy engine
does, so naive and layerwise pay the same link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn


class NaiveCounters:
    """Transfer counters of the naive loader (its stall is every load: nothing hides it)."""

    __slots__ = ("bytes_transferred", "num_transfers", "stall_seconds")

    def __init__(self):
        self.bytes_transferred = 0
        self.num_transfers = 0
        self.stall_seconds = 0.0


class _HostBlock:
    """One block's tensors kept on the host: (owner module, name, is_param, host tensor)."""

    def __init__(self, block: nn.Module, pin: bool):
        self.entries: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
        for module in block.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    self.entries.append((module, name, True, _host_tensor(param.data, pin)))
            for name, buf in module._buffers.items():
                if buf is not None:
                    self.entries.append((module, name, False, _host_tensor(buf, pin)))
        self.nbytes = sum(t.numel() * t.element_size() for *_, t in self.entries)


def _host_tensor(t: torch.Tensor, pin: bool) -> torch.Tensor:
    # the block's own CPU tensor is the host copy (its parameter is rebound to a placeholder), so nothing is doubled
    t = t if t.device.type == "cpu" else t.to("cpu")
    return t.pin_memory() if pin else t


class NaiveBlockLoader:
    """Hooks on each block of `blocks` that load it to `device` before its forward and evict it after."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, *, link_gbps: float | None = None):
        if link_gbps is not None and device.type != "cpu":
            raise ValueError(f"a simulated link applies only to the CPU device, not {device}")
        self.device = device
        self.link_gbps = link_gbps
        self.counters = NaiveCounters()
        self._pending = list(blocks)
        self._blocks: list[tuple[nn.Module, _HostBlock]] = []
        self._hooks: list = []

    def enable_(self) -> None:
        """Move every block's tensors to host copies, evict the block to placeholders and hook it."""
        pin = self.device.type == "cuda"  # page-locked, so the baseline differs from layerwise by overlap alone
        for block in self._pending:
            host = _HostBlock(block, pin)
            self._evict_(host)  # before the next block: a pinned copy and the original coexist for one block only
            self._blocks.append((block, host))
            self._hooks.append(block.register_forward_pre_hook(lambda m, a, h=host: self._load_(h)))
            self._hooks.append(block.register_forward_hook(lambda m, a, o, h=host: self._evict_(h), always_call=True))
        self._pending = []

    @property
    def max_block_bytes(self) -> int:
        return max((host.nbytes for _, host in self._blocks), default=0)

    def _load_(self, host: _HostBlock) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copy below waits for queued compute anyway; this times the load alone
        start = time.perf_counter()
        for module, name, is_param, tensor in host.entries:
            # one synchronous copy per tensor: the host waits for it, and compute cannot start before it lands
            loaded = tensor.to(self.device, copy=True) if self.device.type == "cpu" else tensor.to(self.device)
            if is_param:
                module._parameters[name].data = loaded
            else:
                module._buffers[name] = loaded
        if self.link_gbps is not None:
            remaining = host.nbytes / (self.link_gbps * 1e9) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)  # the simulated link: the load lasts as long as it would on the wire
        self.counters.stall_seconds += time.perf_counter() - start
        self.counters.bytes_transferred += host.nbytes
        self.counters.num_transfers += 1

    def _evict_(self, host: _HostBlock) -> None:
        for module, name, is_param, tensor in host.entries:
            empty = torch.empty(0, dtype=tensor.dtype, device=self.device)
            if is_param:
                module._parameters[name].data = empty
            else:
                module._buffers[name] = empty

    def disable(self) -> None:
        """Remove the hooks and leave every block loaded on the device."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, host in self._blocks:
            for module, name, is_param, tensor in host.entries:
                if is_param:
                    module._parameters[name].data = tensor.to(self.device, copy=True)
                else:
                    module._buffers[name] = tensor.to(self.device, copy=True)
