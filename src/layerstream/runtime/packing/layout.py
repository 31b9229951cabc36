"""A block's packed layout: where each of its tensors lives inside one contiguous buffer (one place per storage
span), and how to rebind them (`as_strided`: non-contiguous and tied tensors come back exactly). Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.packing.file_reads import FileRange, FileReader, MappedFiles
from layerstream.runtime.packing.subclass_tensors import InnerPath, flatten_inner, get_inner, rebuild, set_inner_

ALIGN_BYTES = 64  # slots and buffers start 64-byte aligned, and spans keep their residue mod 64


def align_up(n: int, alignment: int = ALIGN_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a block lives inside the block's buffer."""

    module: nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_offset: int  # of its first element in the block buffer, in elements of `dtype`
    span_index: int  # the storage span it lives in (tensors sharing a span are views of one storage)
    inner: InnerPath = ()  # an inner tensor's attribute path in the wrapper `module.<name>`; () for a plain one
    inference_param: bool = False  # made under `torch.inference_mode()`: only ever rebound to inference tensors


class SpanMember(NamedTuple):
    """One tensor of a storage span, as a `fresh_span` rule sees it."""

    module: nn.Module
    tensor: torch.Tensor
    inner: InnerPath


def tensor_byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of a tensor inside its untyped storage."""
    itemsize = t.element_size()
    start = t.storage_offset() * itemsize
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * itemsize


def inference_alias(t: torch.Tensor) -> torch.Tensor:
    """An inference tensor viewing `t`'s bytes: an inference Parameter whose `.data` is set to a normal tensor fails
    every later use ("Inference tensors do not track version counter")."""
    if t.is_inference():
        return t
    with torch.inference_mode():  # an empty inference tensor, then pointed at t's storage: a view would be normal
        alias = torch.empty(0, dtype=t.dtype, device=t.device)
        return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def iter_block_tensors(block: nn.Module):
    """(module, name, tensor, is_param) for every parameter and buffer of a block, tied ones once per owner."""
    for module in block.modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param, True
        for name, buf in module._buffers.items():
            if buf is not None:
                yield module, name, buf, False


class BlockLayout:
    """The packed layout of one block. Each span keeps the address residue (mod `ALIGN_BYTES`) it would have resident
    on `device` (0 for a `fresh_span`): CPU BLAS kernels round differently at different alignments (MKL's
    matrix-vector product on an AMD EPYC: four roundings over the residues mod 64), and outputs stay bit-identical."""

    def __init__(
        self,
        path: str,
        block: nn.Module,
        device: torch.device | None = None,
        fresh_span: Callable[[list[SpanMember]], bool] | None = None,
        *,
        allow_meta: bool = False,
    ):
        self.path = path
        self.block = block
        self.device = device
        self.entries: list[TensorEntry] = []
        # (source tensor giving access to the storage, source byte start, length, destination byte offset)
        self._spans: list[tuple[torch.Tensor, int, int, int]] = []
        self.span_residues: list[int] = []
        by_storage: dict[tuple[str, int], list[tuple[nn.Module, str, torch.Tensor, bool, InnerPath]]] = {}
        for module, name, outer, is_param in iter_block_tensors(block):
            for inner, tensor in flatten_inner(outer):  # a wrapper subclass packs its inner tensors
                if tensor.device.type == "meta":
                    if not allow_meta:
                        raise ValueError(f"{path}: tensor {name!r} is on the meta device (weights not loaded)")
                    key = ("meta", id(tensor))  # a skeleton's tensors share no storage: each is its own span
                else:
                    key = (str(tensor.device), tensor.untyped_storage().data_ptr())
                by_storage.setdefault(key, []).append((module, name, tensor, is_param, inner))

        offset = 0
        for members in by_storage.values():
            extents = [tensor_byte_extent(t) for _, _, t, _, _ in members]
            start = min(s for s, _ in extents)
            end = max(e for _, e in extents)
            source = members[0][2]
            stays = device is not None and source.device.type != "meta" and _same_device(source.device, device)
            if fresh_span is not None and fresh_span([SpanMember(m, t, i) for m, _, t, _, i in members]):
                stays = False
            residue = (source.untyped_storage().data_ptr() + start) % ALIGN_BYTES if stays else 0
            dst = offset + (residue - offset) % ALIGN_BYTES
            self._spans.append((source, start, end - start, dst))
            self.span_residues.append(residue)
            for module, name, tensor, is_param, inner in members:
                itemsize = tensor.element_size()
                byte_pos = dst + tensor.storage_offset() * itemsize - start
                if byte_pos % itemsize:
                    raise ValueError(f"{path}: tensor {name!r} is not aligned to its element size; it cannot be packed")
                self.entries.append(
                    TensorEntry(
                        module=module,
                        name=name,
                        is_param=is_param,
                        dtype=tensor.dtype,
                        shape=tuple(tensor.shape),
                        stride=tuple(tensor.stride()),
                        element_offset=byte_pos // itemsize,
                        span_index=len(self._spans) - 1,
                        inner=inner,
                        inference_param=is_param and not inner and tensor.is_inference(),
                    )
                )
            offset = dst + end - start
        self.nbytes = max(align_up(offset), ALIGN_BYTES)  # padded; every span at its residue

    def relocated(self, fresh_span: Callable[[list[SpanMember]], bool]) -> BlockLayout:
        """The same block laid out again with the spans `fresh_span` accepts at residue 0 (before staging)."""
        return BlockLayout(self.path, self.block, self.device, fresh_span)

    def copy_sources_into(self, buffer: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        """Copy every original span into `buffer`, reading unwritten views of a file mapping from the file."""
        reads = []
        for src, src_start, length, dst in self._spans:
            if files is not None and reader is not None and src.device.type == "cpu":
                source = files.file_range(src.untyped_storage().data_ptr() + src_start, length)
                if source is not None:
                    reads.append((buffer[dst : dst + length], source))
                    continue
            buffer[dst : dst + length].copy_(_storage_bytes(src, src_start, length))
        if reads:
            reader.read_all_(reads)  # every span of the block in flight at once
        return sum(source.nbytes for _, source in reads)

    def span_file_ranges(self, files: MappedFiles) -> list[tuple[FileRange | None, int, int]]:
        """For every span: (the file bytes that back it, or None), its offset in the packed block, its length."""
        out: list[tuple[FileRange | None, int, int]] = []
        for src, src_start, length, dst in self._spans:
            source = None
            if src is not None and src.device.type == "cpu" and length > 0:
                source = files.file_range(src.untyped_storage().data_ptr() + src_start, length)
            out.append((source, dst, length))
        return out

    def span_placements(self) -> list[tuple[int, int]]:
        """(destination byte offset, length) of every storage span in the packed buffer, in buffer order."""
        return [(dst, length) for _, _, length, dst in self._spans]

    def span_source(self, index: int) -> torch.Tensor:
        """The original bytes of span `index` (uint8, viewing the original storage; before `forget_sources`)."""
        src, src_start, length, _ = self._spans[index]
        assert src is not None, f"{self.path}: the sources were forgotten"
        return _storage_bytes(src, src_start, length)

    def copy_range_into(self, buffer: torch.Tensor, start: int) -> None:
        """Copy bytes [start, start + buffer.numel()) of the packed block from the originals (padding untouched)."""
        end = start + buffer.numel()
        for src, src_start, length, dst in self._spans:
            lo, hi = max(dst, start), min(dst + length, end)
            if lo < hi:
                buffer[lo - start : hi - start].copy_(_storage_bytes(src, src_start + lo - dst, hi - lo))

    def buffer_byte_ranges(self) -> list[tuple[int, int]]:
        """[start, end) bytes of every buffer (not parameter) entry in the packed block, merged where they touch."""
        ranges = []
        for e in self.entries:
            if e.is_param or any(size == 0 for size in e.shape):
                continue
            itemsize = e.dtype.itemsize
            start = e.element_offset * itemsize
            extent = (sum((size - 1) * stride for size, stride in zip(e.shape, e.stride)) + 1) * itemsize
            ranges.append((start, start + extent))
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def source_device(self) -> torch.device:
        """The device the block's original tensors live on (CPU for a block without tensors)."""
        for source, *_ in self._spans:
            if source is not None:
                return source.device
        return torch.device("cpu")

    def forget_sources(self) -> None:
        """Drop the references to the original storages so they can be freed."""
        self._spans = [(None, s, n, d) for _, s, n, d in self._spans]  # type: ignore[misc]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per entry, viewing `buffer` (uint8, at least `nbytes`) with the original shape and strides."""
        return self._strided([buffer] * len(self._spans), [0] * len(self._spans))

    def separate_copies(self, buffer: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        """Like `views`, each span in fresh storage on `device` at the same address residue (what disable binds)."""
        raws, shifts = [], []
        for (_, _, length, dst), residue in zip(self._spans, self.span_residues):
            raw = torch.empty(align_up(length + ALIGN_BYTES), dtype=torch.uint8, device=device)
            shift = (residue - raw.data_ptr()) % ALIGN_BYTES
            raw[shift : shift + length].copy_(buffer[dst : dst + length])
            raws.append(raw)
            shifts.append(shift - dst)  # buffer offset -> offset inside raw
        return self._strided(raws, shifts)

    def _strided(self, raws: list[torch.Tensor], shifts: list[int]) -> list[torch.Tensor]:
        # built outside inference mode and autograd whatever mode the caller runs in: the cached views must look to
        # every kernel like the resident parameters (an inference tensor would change later kernels' paths)
        with torch.inference_mode(False), torch.no_grad():
            typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
            out = []
            for e in self.entries:
                base = typed.get((e.span_index, e.dtype))
                if base is None:
                    base = typed[e.span_index, e.dtype] = raws[e.span_index].view(e.dtype)
                offset = base.storage_offset() + e.element_offset + shifts[e.span_index] // base.element_size()
                tensor = torch.as_strided(base, e.shape, e.stride, offset)
                out.append(inference_alias(tensor) if e.inference_param else tensor)
            return out


class TensorBinder:
    """Rebinds a block's tensors: parameters through `.data` (identity kept), buffers by assignment, as normal
    tensors (an in-place write must move the slot's version counter, which an inference tensor has not)."""

    def __init__(self, layout: BlockLayout, device: torch.device):
        self.layout = layout
        params: dict[int, int] = {}
        self._param_slots: list[tuple[nn.Parameter, int]] = []
        self._buffer_slots: list[tuple[dict, str, int]] = []
        self._inner_slots: list[tuple[torch.Tensor, InnerPath, int]] = []  # (wrapper, inner path, entry)
        self._wrappers: dict[int, tuple[torch.Tensor, list[tuple[InnerPath, int]]]] = {}
        self._inference_entries = frozenset(i for i, e in enumerate(layout.entries) if e.inference_param)
        for i, e in enumerate(layout.entries):
            if e.inner:
                wrapper = (e.module._parameters if e.is_param else e.module._buffers)[e.name]
                self._inner_slots.append((wrapper, e.inner, i))
                self._wrappers.setdefault(id(wrapper), (wrapper, []))[1].append((e.inner, i))
            elif e.is_param:
                param = e.module._parameters[e.name]
                if id(param) not in params:  # a parameter tied inside the block is rebound once
                    params[id(param)] = i
                    self._param_slots.append((param, i))
            else:
                self._buffer_slots.append((e.module._buffers, e.name, i))
        # empty tensors of each dtype on the compute device: any read of an evicted weight fails on its shape
        placeholder_for = {}
        for e in layout.entries:
            if (e.dtype, e.inference_param) not in placeholder_for:
                with torch.inference_mode(e.inference_param):
                    placeholder_for[e.dtype, e.inference_param] = torch.empty(0, dtype=e.dtype, device=device)
        self._placeholder_list = [placeholder_for[e.dtype, e.inference_param] for e in layout.entries]
        self.bound = False  # real bytes (a slot's or the host store's) rather than placeholders

    def current_tensors(self) -> list[torch.Tensor]:
        """The tensors `bind_` would replace, one per entry (a parameter's `.data`, or the buffer)."""
        return [e.module._parameters[e.name].data if e.is_param else e.module._buffers[e.name] for e in self.layout.entries]

    def bind_(self, views: list[torch.Tensor]) -> None:
        self.bound = True
        inference = self._inference_entries
        for param, i in self._param_slots:
            param.data = inference_alias(views[i]) if i in inference else views[i]
        for buffers, name, i in self._buffer_slots:
            buffers[name] = views[i]
        for wrapper, inner_slots in self._wrappers.values():
            device = views[inner_slots[0][1]].device
            if wrapper.device != device:
                # the wrapper's own metadata names a device: make it the inner tensors' (same object and type)
                wrapper.data = rebuild(wrapper, {path: views[i] for path, i in inner_slots})
            for path, i in inner_slots:
                set_inner_(wrapper, path, views[i])

    def public_tensors(self, views: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per entry, the tensor the model shows when bound to `views`: the view (of a Parameter subclass's own
        class), or for a wrapper subclass's first inner tensor a new wrapper over the views (None for the others)."""
        out: list[torch.Tensor | None] = list(views)
        for param, i in self._param_slots:
            if type(param) is not nn.Parameter and out[i] is not None:
                # a Parameter subclass with storage of its own (diffusers' GGUF weights): the same class and
                # attributes (quantization type) over the view, as `param.detach()` gives resident
                shown = torch.Tensor._make_subclass(type(param), out[i], False)
                shown.__dict__.update({k: v for k, v in param.__dict__.items() if k != "_is_param"})
                out[i] = shown
        for wrapper, inner_slots in self._wrappers.values():
            for _, i in inner_slots:
                out[i] = None
            out[inner_slots[0][1]] = rebuild(wrapper, {path: views[i] for path, i in inner_slots})
        return out

    def keep_replaced_(self, views: list[torch.Tensor]) -> int:
        """Copy into `views` the tensors code replaced while bound instead of writing into them (`param.data = new`,
        as PEFT's safe merge does); returns how many. Raises `UnsupportedUseError` for a new shape or dtype."""
        replaced = [(param.data, i) for param, i in self._param_slots]
        replaced += [(buffers[name], i) for buffers, name, i in self._buffer_slots]
        replaced += [(get_inner(wrapper, path), i) for wrapper, path, i in self._inner_slots]
        num_copied = 0
        for data, i in replaced:
            view = views[i]
            if data.data_ptr() == view.data_ptr() and data.shape == view.shape and data.stride() == view.stride():
                continue
            if data.shape != view.shape or data.dtype != view.dtype:
                e = self.layout.entries[i]
                raise UnsupportedUseError(
                    f"{self.layout.path}: {type(e.module).__name__}.{e.name} was replaced by a tensor of shape "
                    f"{tuple(data.shape)} and dtype {data.dtype}, not {tuple(view.shape)} {view.dtype}; a streamed "
                    "block's tensors keep their shape and dtype (call handle.disable() first)"
                )
            if view.is_inference():
                with torch.inference_mode():  # an inference tensor may be written only in inference mode
                    view.copy_(data)
            else:
                view.copy_(data)
            num_copied += 1
        return num_copied

    def any_requires_grad(self) -> bool:
        return any(param.requires_grad for param, _ in self._param_slots) or any(
            w.requires_grad for w, _ in self._wrappers.values()
        )

    def evict_(self) -> None:
        self.bind_(self._placeholder_list)
        self.bound = False


def _storage_bytes(src: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Bytes [start, start + length) of `src`'s untyped storage, as a uint8 view."""
    raw = torch.empty(0, dtype=torch.uint8, device=src.device)
    return raw.set_(src.untyped_storage(), start, (length,), (1,))


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index or 0) == (b.index or 0)
    return True
