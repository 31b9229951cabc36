"""The peak of live tensor bytes while a call runs on the meta device: every tensor the call allocates is
counted from the op that makes it until its storage is freed, as the caching allocator of an accelerator would
see it, with no byte of data and no weight read.

Meta kernels compute shapes only, but many are Python reference implementations (about 0.25 ms an op), so a
decoder that runs the same layers for every frame and tile repeats the same shape computations thousands of
times: outputs of ops that allocate fresh storage are remembered by their inputs' shapes and rebuilt with one
``empty_strided`` (a Wan 2.x decode of 21 latent frames: 10,644 ops, 2.1 s without the memory, ~0.5 s with it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from layerstream.models.decode.conv_scratch import DeviceType, convolution_scratch_nbytes


@dataclass(frozen=True)
class _FreshTensor:
    """One remembered output, rebuilt on the meta device on the next call with the same inputs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _arg_key(value: Any) -> Any:
    """What an op's or a call's result shapes depend on (where in its storage a tensor starts does not)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _arg_key(v)) for k, v in value.items()))
    return value


@functools.cache
def _allocates_fresh(func: Any) -> bool:
    """True for an op whose outputs are new tensors: no output aliases an input and no input is written."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class MetaPeakTracker(TorchDispatchMode):
    """Counts the bytes of every storage the traced call creates; `peak_nbytes` is the most alive at once (not
    counting the storages alive when tracing starts: the inputs, the module's parameters)."""

    def __init__(self, device_type: DeviceType = "cuda") -> None:
        super().__init__()
        self.device_type = device_type
        """Whose kernels' scratch to count: the CPU's (oneDNN, or ATen's unfolding kernel) or CUDA's."""
        self.live_nbytes = 0
        self.peak_nbytes = 0
        self.num_ops = 0
        self.flops = 0
        """The convolutions' multiply-adds, two FLOPs each (replayed calls included): the decode's work."""
        self.num_storages = 0
        """Storages counted so far: a storage is fresh to a call if its serial is above the count at its start."""
        self.quiet = False
        """While True, storages are counted live but the peak is left alone (a replayed call sets it itself)."""
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._shapes: dict[Any, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_ops += 1
        out = self._run(func, args, kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        if func is torch.ops.aten.convolution.default:
            self.flops += convolution_flops(args, out)
            if not self.quiet:  # the kernel's scratch beside its output, while it runs (`conv_scratch`)
                scratch = convolution_scratch_nbytes(self.device_type, args, out)
                self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes + scratch)
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
        self.num_storages += 1
        self._seen[storage] = self.num_storages
        weakref.finalize(storage, self._free, nbytes)
        self.live_nbytes += nbytes
        if not self.quiet:
            self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)

    def serial(self, tensor: torch.Tensor) -> int:
        """The serial number of `tensor`'s storage (0: it was alive before tracing began)."""
        return self._seen.get(tensor.untyped_storage(), 0)

    def _free(self, nbytes: int) -> None:
        self.live_nbytes -= nbytes


def convolution_flops(args: tuple, out: torch.Tensor) -> int:
    """Two per multiply-add of ``aten.convolution(input, weight, bias, stride, padding, dilation, transposed, ...)``:
    each output element (each input element, transposed) meets ``weight.shape[1]`` channels times the kernel."""
    data, weight, transposed = args[0], args[1], args[6]
    return 2 * (data if transposed else out).numel() * weight.shape[1] * math.prod(weight.shape[2:])


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


def trace_call(
    call: Callable[[], Any], *, replayed: Iterable[nn.Module] = (), device_type: DeviceType = "cuda"
) -> MetaPeakTracker:
    """Runs `call` on meta tensors, under no_grad, counted by the `MetaPeakTracker` it returns; the calls of each
    module of `replayed` (whose result depends on its arguments alone) are recorded and replayed."""
    tracker = MetaPeakTracker(device_type)
    with contextlib.ExitStack() as stack:
        for module in replayed:
            stack.enter_context(replayed_calls(module, tracker))
        with torch.no_grad(), FusedAttention(), tracker:
            result = call()
            del result
    return tracker


_SAME = object()
"""In a recorded call's list contents: the element the list held before the call, left in place."""
_UNREPLAYABLE = object()
"""A recorded call whose results alias tensors alive before it (or each other): it is always run."""


@dataclass(frozen=True)
class _CallRecord:
    """What one module call did to memory: the most bytes it added while running, what it returned and what it
    left in the lists it was passed (Wan's feature cache and its index are lists the decoder rewrites)."""

    increment_nbytes: int
    result: Any
    lists_after: tuple[tuple[Any, ...], ...]
    flops: int


@contextlib.contextmanager
def replayed_calls(module: nn.Module, tracker: MetaPeakTracker) -> Iterator[None]:
    """Within the block, a call of `module` with the argument shapes (list contents included) of an earlier one
    replays its record: the peak rises by the recorded increment over what is live now, and the results and list
    contents are rebuilt as fresh meta tensors without running an op. A decoder called once per latent frame and
    tile repeats a handful of distinct calls (Wan 2.x at 1280x720, 81 frames, tiled: 588 calls, 3 distinct)."""
    run = module.forward
    records: dict[Any, Any] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            key = (_arg_key(args), _arg_key(kwargs))
            record = records.get(key)
        except TypeError:  # an unhashable argument: run it
            return run(*args, **kwargs)
        if record is _UNREPLAYABLE:
            return run(*args, **kwargs)
        if record is not None:
            return _replay(record, _list_arguments(args, kwargs), tracker)
        result, records[key] = _record(run, args, kwargs, tracker)
        return result

    had_own_forward = "forward" in vars(module)
    module.forward = forward
    try:
        yield
    finally:
        if had_own_forward:
            module.forward = run
        else:
            del module.forward


def _list_arguments(args: tuple, kwargs: dict) -> list[list]:
    return [value for value in (*args, *kwargs.values()) if isinstance(value, list)]


def _record(run: Callable, args: tuple, kwargs: dict, tracker: MetaPeakTracker) -> tuple[Any, Any]:
    lists = _list_arguments(args, kwargs)
    # weak references only: holding the old entries would keep alive what the call frees
    before = [[weakref.ref(v) if isinstance(v, torch.Tensor) else None for v in values] for values in lists]
    first_serial, entry_nbytes, outer_peak, entry_flops = tracker.num_storages, tracker.live_nbytes, tracker.peak_nbytes, tracker.flops
    tracker.peak_nbytes = entry_nbytes
    try:
        result = run(*args, **kwargs)
    finally:
        increment = tracker.peak_nbytes - entry_nbytes
        tracker.peak_nbytes = max(outer_peak, tracker.peak_nbytes)
    lists_after = tuple(
        tuple(_SAME if i < len(refs) and refs[i] is not None and refs[i]() is v else v for i, v in enumerate(values))
        for values, refs in zip(lists, before)
    )
    made = [t for t in tree_flatten((result, lists_after))[0] if isinstance(t, torch.Tensor)]
    storages = {id(t.untyped_storage()) for t in made}
    if len(storages) != len(made) or not all(_is_whole_fresh(t, tracker, first_serial) for t in made):
        return result, _UNREPLAYABLE
    return result, _CallRecord(increment, tree_map(_spec_of, result), tree_map(_spec_of, lists_after), tracker.flops - entry_flops)


def _is_whole_fresh(tensor: torch.Tensor, tracker: MetaPeakTracker, first_serial: int) -> bool:
    """Made by the call, and the whole of its storage (so `empty_strided` rebuilds the same bytes)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == extent * tensor.element_size()
    return whole and tracker.serial(tensor) > first_serial


def _replay(record: _CallRecord, lists: list[list], tracker: MetaPeakTracker) -> Any:
    tracker.peak_nbytes = max(tracker.peak_nbytes, tracker.live_nbytes + record.increment_nbytes)
    tracker.flops += record.flops
    tracker.quiet = True  # the rebuilt tensors replace what the call freed; the peak is set above
    try:
        for values, after in zip(lists, record.lists_after):
            values[:] = [old if spec is _SAME else _rebuild(spec) for old, spec in zip(values, after)] + [
                _rebuild(spec) for spec in after[len(values) :]
            ]
        return tree_map(_rebuild, record.result)
    finally:
        tracker.quiet = False
