"""The peak of live tensor bytes while a call runs on the meta device: every tensor the call allocates is
counted from the op that makes it until its storage is freed, as the caching allocator of an accelerator would
see it, with no byte of data and no weight read.

Meta kernels compute shapes only, but many are Python reference implementations (about 0.25 ms an op), so a
decoder that runs the same layers for every frame and tile repeats the same shape computations thousands of
times: outputs of ops that allocate fresh storage are remembered by their inputs' shapes and rebuilt with one
``empty_strided`` (a Wan 2.x decode of 21 latent frames: 10,644 ops, 2.1 s without the memory, ~0.5 s with it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class _FreshTensor:
    """One remembered output, rebuilt on the meta device on the next call with the same inputs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _arg_key(v)) for k, v in value.items()))
    return value


def _allocates_fresh(func: Any) -> bool:
    """True for an op whose outputs are new tensors: no output aliases an input and no input is written."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class MetaPeakTracker(TorchDispatchMode):
    """Counts the bytes of every storage the traced call creates; `peak_nbytes` is the most alive at once.

    Storages alive when tracing starts (the inputs, the module's meta parameters) are not counted: the caller
    adds what it holds itself."""

    def __init__(self) -> None:
        super().__init__()
        self.live_nbytes = 0
        self.peak_nbytes = 0
        self.num_ops = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._shapes: dict[Any, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_ops += 1
        out = self._run(func, args, kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _run(self, func, args, kwargs):
        if not _allocates_fresh(func):
            return func(*args, **kwargs)
        try:
            key = (func, _arg_key(args), _arg_key(kwargs))
            remembered = self._shapes.get(key)
        except TypeError:  # an unhashable argument: run it
            return func(*args, **kwargs)
        if remembered is None:
            out = func(*args, **kwargs)
            self._shapes[key] = tree_map(_spec_of, out)
            return out
        return tree_map(_rebuild, remembered)

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        weakref.finalize(storage, self._free, nbytes)
        self.live_nbytes += nbytes
        self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)

    def _free(self, nbytes: int) -> None:
        self.live_nbytes -= nbytes


def _spec_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _FreshTensor(tuple(value.shape), value.stride(), value.dtype)
    return value


def _rebuild(value: Any) -> Any:
    if isinstance(value, _FreshTensor):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    return value


class FusedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` as the fused kernels run it (flash on CUDA and on the CPU): the output
    only, never the (tokens x tokens) score matrix the meta device's math fallback would build."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, value = args[0], (args[2] if len(args) > 2 else kwargs["value"])
            return query.new_empty((*query.shape[:-1], value.shape[-1]))
        return func(*args, **kwargs)


def trace_peak_nbytes(call: Callable[[], Any]) -> tuple[int, int]:
    """Runs `call` (on meta tensors, under no_grad) and returns (peak live bytes, ops traced)."""
    tracker = MetaPeakTracker()
    with torch.no_grad(), FusedAttention(), tracker:
        result = call()
        del result
    return tracker.peak_nbytes, tracker.num_ops
