"""Autograd through streamed blocks: a saved tensor that aliases a slot is kept as a reference into the host
store and made again in backward at the same address residue (gradients bit-identical to resident).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerstream.runtime.packing.layout import ALIGN_BYTES, align_up
from layerstream.runtime.contracts import StoredBlock


class SlotAlias:
    """A saved tensor that aliased a slot: where its bytes are in the block's packed layout."""

    __slots__ = ("host", "offset", "dtype", "shape", "stride", "device")

    def __init__(self, host: StoredBlock, offset: int, t: torch.Tensor):
        self.host = host
        self.offset = offset
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.device = t.device

    def materialize(self) -> torch.Tensor:
        """A fresh device tensor with the saved tensor's bytes, shape, strides and address residue."""
        itemsize = self.dtype.itemsize
        if any(size == 0 for size in self.shape):
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        extent = (sum((size - 1) * stride for size, stride in zip(self.shape, self.stride)) + 1) * itemsize
        source = self.host.host_range(self.offset, extent)
        raw = torch.empty(align_up(extent + ALIGN_BYTES), dtype=torch.uint8, device=self.device)
        shift = (self.offset - raw.data_ptr()) % ALIGN_BYTES  # the residue the tensor had in the slot
        raw[shift : shift + extent].copy_(source)
        return torch.as_strided(raw.view(self.dtype), self.shape, self.stride, shift // itemsize)


def slot_saved_tensor_hooks(find_slot_owner: Callable[[torch.Tensor], tuple[StoredBlock, int] | None]):
    """A `saved_tensors_hooks` context; `find_slot_owner(t)`: (stored block, offset in its slot) or None."""

    def pack(t: torch.Tensor):
        owner = find_slot_owner(t)
        if owner is None:
            return t
        host, offset = owner
        return SlotAlias(host, offset, t)

    def unpack(saved):
        return saved.materialize() if isinstance(saved, SlotAlias) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
