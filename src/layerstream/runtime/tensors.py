"""Small helpers over a module's tensors: moving the non-streamed ones, and counting device bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under `module`, tied ones once per owner."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def move_tensors_(
    root: nn.Module, root_path: str, skip: set[str], device: torch.device, push_undo: Callable[[Callable[[], None]], None]
) -> None:
    """Move every parameter and buffer under `root` to `device`, except inside the modules at `skip` paths;
    pushes one undo step per moved tensor (parameters keep their identity: they move through `.data`)."""
    moved: set[int] = set()
    stack = [(root_path, root)]
    while stack:
        path, module = stack.pop()
        if path in skip:
            continue
        for param in module._parameters.values():
            if param is None or id(param) in moved or param.device == device:
                continue
            moved.add(id(param))
            old = param.data
            param.data = old.to(device)
            push_undo(lambda p=param, o=old: setattr(p, "data", o))
        for name, buf in module._buffers.items():
            if buf is None or buf.device == device:
                continue
            module._buffers[name] = buf.to(device)
            push_undo(lambda b=module._buffers, n=name, o=buf: b.__setitem__(n, o))
        for child_name, child in module._modules.items():
            if child is not None:
                stack.append((f"{path}.{child_name}" if path else child_name, child))


def device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of the module's tensors on `device` (evicted blocks hold empty placeholders and count 0)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, t in named_tensors(module):
        if t.device != device or t.numel() == 0:
            continue
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
