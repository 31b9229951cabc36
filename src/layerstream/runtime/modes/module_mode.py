"""Mode "module": whole components move to the device when a call starts and back to the host when it ends (model
CPU offload, a baseline for the benchmarks and for VAEs); nested calls (decode calling forward) swap once.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.runtime.modes.hooks import HookSet
from layerstream.runtime.streaming.ownership import CallOwnership
from layerstream.runtime.modes.undo import UndoStack
from layerstream.runtime.packing.tensors import module_device
from layerstream.runtime.reporting.stats import ComponentStats, OffloadStats, OffloadTrace
from layerstream.runtime.streaming.wrapping import MethodWrapper

OFFLOAD_DEVICE = torch.device("cpu")
SWAPPED_METHODS = ("forward", "encode", "decode")  # diffusers calls `vae.decode(...)`, never `vae(...)`


def _module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class ModuleModeBackend:
    """Swaps the plan's "swap" components on and off the device around their calls."""

    streamer = None  # nothing streams block by block
    placement = None

    def __init__(self, plan: ResolvedOffloadPlan, components: Mapping[str, nn.Module], device: torch.device):
        self.plan = plan
        self.components = components
        self.device = device
        self.hooks = HookSet()
        self.bytes = {c.path: _module_bytes(components[c.path]) for c in plan.components if c.action == "swap"}
        self.transfers = {path: 0 for path in self.bytes}
        self.depth = {path: 0 for path in self.bytes}
        self.ownership = CallOwnership(plan.pipeline_class)  # a second thread would move a component under the first
        self.moved_by_own_to: dict[str, torch.device] = {}  # components with their own `to()` -> where they were

    def install_(self) -> None:
        display = {c.path: c.display_path for c in self.plan.components}
        for path in self.bytes:
            module = self.components[path]
            for name in SWAPPED_METHODS:
                if callable(getattr(module, name, None)):
                    wrapper = MethodWrapper(module, name, lambda p=path: self._onload_(p), lambda p=path: self._offload_(p))
                    self.hooks.add(display[path], f"swap.{name}", "moves the component to the device around the call", wrapper.remove)

    def _onload_(self, path: str) -> None:
        self.ownership.enter()
        self.depth[path] += 1
        if self.depth[path] == 1:
            self.components[path].to(self.device)
            self.transfers[path] += 1

    def _offload_(self, path: str) -> None:
        try:
            self.depth[path] -= 1
            if self.depth[path] == 0:
                self.components[path].to(OFFLOAD_DEVICE)
        finally:
            self.ownership.exit()

    def stats(self) -> OffloadStats:
        per = {}
        for c in self.plan.components:
            if c.action == "swap":
                per[c.display_path] = ComponentStats(
                    bytes_transferred=self.transfers[c.path] * self.bytes[c.path],
                    num_transfers=self.transfers[c.path],
                    host_bytes=self.bytes[c.path],
                )
            elif c.action == "resident":
                per[c.display_path] = ComponentStats(device_bytes=_module_bytes(self.components[c.path]))
        totals = {f: sum(getattr(s, f) for s in per.values()) for f in ComponentStats.__dataclass_fields__}
        # while a swapped component runs it is on the device too: count the largest one
        totals["device_bytes"] += max(self.bytes.values(), default=0)
        return OffloadStats(**totals, per_component=MappingProxyType(per), engine="module-swap")

    def block_transfers(self) -> dict[str, int]:
        return {}

    def trace(self) -> OffloadTrace:
        return OffloadTrace(())  # whole-module swaps run on the compute thread; there is no copy lane to show

    def reset_trace(self) -> None:
        pass

    def release_when_dropped(self) -> None:
        return None  # nothing runs beside the model and nothing is held off it: a dropped pipeline frees itself

    def disable(self) -> None:
        self.hooks.remove_all_()
        for path in self.bytes:
            self.components[path].to(self.device)
        for path, original in self.moved_by_own_to.items():
            self.components[path].to(original)  # a component that moves itself goes back where enable found it
        self.moved_by_own_to = {}


def apply_module_mode(
    plan: ResolvedOffloadPlan, components: Mapping[str, nn.Module], device: torch.device, undo: UndoStack
) -> ModuleModeBackend:
    """Swapped components to the host, the rest to the device (each through its `to()` once); wrap the swapped."""
    backend = ModuleModeBackend(plan, components, device)
    for comp in plan.components:
        module = components[comp.path]
        original = module_device(module)
        undo.push(lambda m=module, d=original: m.to(d))
        module.to(OFFLOAD_DEVICE if comp.action == "swap" else device)
        if comp.own_to is not None:
            backend.moved_by_own_to[comp.path] = original
    undo.push(backend.hooks.remove_all_)
    backend.install_()
    return backend
