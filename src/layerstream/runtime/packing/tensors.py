"""Small helpers over a module's tensors: moving the non-streamed ones, and counting device bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import inference_alias
from layerstream.runtime.packing.subclass_tensors import plain_tensors


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under `module`, tied ones once per owner."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def replace_tensors_(
    root: nn.Module,
    root_path: str,
    skip: set[str],
    convert: Callable[[torch.Tensor], torch.Tensor | None],
    push_undo: Callable[[Callable[[], None]], None],
) -> None:
    """Replace every parameter and buffer under `root` (outside `skip`) by `convert(tensor)` where not None, one undo
    step each; parameters keep their identity (`.data`, inference ones aliased), tied ones converted once."""
    seen: set[int] = set()
    stack = [(root_path, root)]
    while stack:
        path, module = stack.pop()
        if path in skip:
            continue
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            new = convert(param.data)
            if new is not None:
                if param.is_inference() and not is_traceable_wrapper_subclass(new):
                    new = inference_alias(new)
                old = param.data
                param.data = new
                push_undo(lambda p=param, o=old: setattr(p, "data", o))
        for name, buf in module._buffers.items():
            new = convert(buf) if buf is not None else None
            if new is not None:
                module._buffers[name] = new
                push_undo(lambda b=module._buffers, n=name, o=buf: b.__setitem__(n, o))
        for child_name, child in module._modules.items():
            if child is not None:
                stack.append((f"{path}.{child_name}" if path else child_name, child))


def move_tensors_(
    root: nn.Module, root_path: str, skip: set[str], device: torch.device, push_undo: Callable[[Callable[[], None]], None]
) -> None:
    """Move every parameter and buffer under `root` to `device`, except inside the modules at `skip` paths."""
    replace_tensors_(root, root_path, skip, lambda t: None if t.device == device else t.to(device), push_undo)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter, else of its first buffer, else the CPU."""
    for t in chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


def device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of the module's tensors on `device` (evicted blocks hold empty placeholders and count 0)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, outer in named_tensors(module):
        for t in plain_tensors(outer):  # a wrapper subclass's bytes are its inner tensors
            if t.device != device or t.numel() == 0:
                continue
            key = (t.data_ptr(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def unmap_tensors_(
    root: nn.Module,
    root_path: str,
    skip: set[str],
    files: MappedFiles,
    reader: FileReader,
    push_undo: Callable[[Callable[[], None]], None],
) -> int:
    """Give every CPU tensor under `root` still viewing a file mapping a storage of its own at the same residue."""
    copies: dict[int, torch.Tensor] = {}
    copied = 0

    def moved(t: torch.Tensor) -> torch.Tensor | None:
        nonlocal copied
        # wrapper subclasses: left as they are
        if t.device.type != "cpu" or t.numel() == 0 or is_traceable_wrapper_subclass(t):
            return None
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if not files.covers(address, nbytes):
            return None
        raw = copies.get(address)
        if raw is None:
            original = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            padded = torch.empty(nbytes + 64, dtype=torch.uint8)
            shift = (address - padded.data_ptr()) % 64
            raw = copies[address] = padded[shift : shift + nbytes]
            source = files.file_range(address, nbytes)
            if source is not None:
                reader.read_into_(raw, source)  # from the file: the mapping's pages are never faulted in
            else:
                raw.copy_(original)
            copied += nbytes
        itemsize = t.element_size()
        if raw.storage_offset() % itemsize:  # a misaligned source: keep the bytes, not the residue
            return t.clone()
        typed = raw.view(t.dtype)
        return torch.as_strided(typed, t.shape, t.stride(), typed.storage_offset() + t.storage_offset())

    replace_tensors_(root, root_path, skip, moved, push_undo)
    return copied
