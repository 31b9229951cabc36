"""Tensor subclasses that wrap inner tensors (torchao's quantized weights): a traceable wrapper has no storage of
its own, so each (possibly nested) inner tensor is packed like a plain tensor and bound by setting the wrapper's
attribute to a view of the slot; the Parameter object and its metadata stay the same. (Diffusers' GGUF weights
have storage of their own and pack as plain tensors.)
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

InnerPath = tuple[str, ...]  # attribute names from a wrapper down to an inner tensor; () for a plain tensor


def flatten_inner(t: torch.Tensor, prefix: InnerPath = ()) -> list[tuple[InnerPath, torch.Tensor]]:
    """(path, plain tensor) for every inner tensor of `t` (`[((), t)]` for a plain tensor)."""
    if not is_traceable_wrapper_subclass(t):
        return [(prefix, t)]
    names, _ = t.__tensor_flatten__()
    out: list[tuple[InnerPath, torch.Tensor]] = []
    for name in names:
        out += flatten_inner(getattr(t, name), prefix + (name,))
    return out


def get_inner(t: torch.Tensor, path: InnerPath) -> torch.Tensor:
    for name in path:
        t = getattr(t, name)
    return t


def set_inner_(t: torch.Tensor, path: InnerPath, value: torch.Tensor) -> None:
    """Point the inner tensor at `path` of wrapper `t` to `value` (the wrapper object stays the same)."""
    owner = get_inner(t, path[:-1])
    setattr(owner, path[-1], value)


def rebuild(t: torch.Tensor, values: dict[InnerPath, torch.Tensor], prefix: InnerPath = ()) -> torch.Tensor:
    """A new wrapper like `t` (same type and metadata) whose inner tensors are `values` (by path)."""
    if not is_traceable_wrapper_subclass(t):
        return values[prefix]
    names, meta = t.__tensor_flatten__()
    inner = {name: rebuild(getattr(t, name), values, prefix + (name,)) for name in names}
    return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())


def unpackable_reason(t: torch.Tensor) -> str | None:
    """Why `t` cannot be packed as bytes (None where it can): every inner tensor needs storage of its own."""
    try:
        inner = flatten_inner(t)
    except Exception as e:  # a wrapper whose flatten fails
        return f"its __tensor_flatten__ failed: {e}"
    for path, tensor in inner:
        try:
            tensor.untyped_storage().data_ptr()  # a wrapper without inner tensors has an invalid storage
        except (RuntimeError, NotImplementedError, TypeError):
            where = f"inner tensor {'.'.join(path)}" if path else "it"
            return f"{where} has no storage of its own"
    return None


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding `t`'s bytes: `t` itself, or its inner tensors."""
    return [inner for _, inner in flatten_inner(t)]
