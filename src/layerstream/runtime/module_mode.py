"""Mode "module": whole components move to the device when their forward starts and back when it ends.

This is the familiar model CPU offload, kept as a baseline for the benchmarks and for VAEs.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from layerstream.runtime.stats import ComponentStats, OffloadStats

OFFLOAD_DEVICE = torch.device("cpu")


def _module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class ModuleSwapper:
    def __init__(self, plan, components: dict[str, nn.Module], device: torch.device):
        self.plan = plan
        self.components = components
        self.device = device
        self.hooks: list = []
        self.bytes = {c.path: _module_bytes(components[c.path]) for c in plan.components if c.action == "swap"}
        self.transfers = {path: 0 for path in self.bytes}
        self.depth = {path: 0 for path in self.bytes}

    def install(self) -> None:
        for path in self.bytes:
            module = self.components[path]
            self.hooks.append(module.register_forward_pre_hook(lambda m, a, p=path: self._onload_(p)))
            self.hooks.append(module.register_forward_hook(lambda m, a, o, p=path: self._offload_(p), always_call=True))

    def _onload_(self, path: str) -> None:
        self.depth[path] += 1
        if self.depth[path] == 1:
            self.components[path].to(self.device)
            self.transfers[path] += 1

    def _offload_(self, path: str) -> None:
        self.depth[path] -= 1
        if self.depth[path] == 0:
            self.components[path].to(OFFLOAD_DEVICE)

    def stats(self) -> OffloadStats:
        per = {}
        for c in self.plan.components:
            if c.action == "swap":
                per[c.path] = ComponentStats(
                    bytes_transferred=self.transfers[c.path] * self.bytes[c.path],
                    num_transfers=self.transfers[c.path],
                    host_bytes=self.bytes[c.path],
                )
            elif c.action == "resident":
                per[c.path] = ComponentStats(device_bytes=_module_bytes(self.components[c.path]))
        totals = {f: sum(getattr(s, f) for s in per.values()) for f in ComponentStats.__dataclass_fields__}
        # while a swapped component runs it is on the device too: count the largest one
        totals["device_bytes"] += max(self.bytes.values(), default=0)
        return OffloadStats(**totals, per_component=MappingProxyType(per), engine="module-swap")

    def disable(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for path in self.bytes:
            self.components[path].to(self.device)


def enable_module_mode(pipeline, plan, components: dict[str, nn.Module], device: torch.device, *, mark: str):
    from layerstream.runtime.enable import OffloadHandle

    handle = OffloadHandle(plan, device)
    swapper = ModuleSwapper(plan, components, device)
    moved: list[tuple[nn.Module, torch.device]] = []
    try:
        for comp in plan.components:
            module = components[comp.path]
            if comp.action == "on_demand":
                module.offload_to_cpu()
            elif comp.action == "swap":
                moved.append((module, _device_of(module)))
                module.to(OFFLOAD_DEVICE)
            else:
                moved.append((module, _device_of(module)))
                module.to(device)
        swapper.install()
    except BaseException:
        swapper.disable()
        for module, original in moved:
            module.to(original)
        raise
    for module in components.values():
        setattr(module, mark, handle)
    handle._components = components
    handle._module_swapper = swapper
    return handle


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return OFFLOAD_DEVICE
