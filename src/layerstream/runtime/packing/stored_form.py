"""The packed form of a block (`contracts.StoredForm`): its bytes kept as its packed layout, byte for byte.

Every store that keeps bytes (local, sharded, disk) keeps each block in its store's form: the packed form here,
or the float8 form (`runtime.stores.cast_store.CastLayout`), which keeps the cast spans in float8 and unpacks
them in the slot. `SlotUnpack` runs a form's unpacking copies in a slot, built once per slot.
"""

from __future__ import annotations

import torch

from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout


class PackedForm:
    """A block kept as its packed layout: the stored bytes are the compute layout, nothing to unpack."""

    lossless = True
    stored_is_packed = True
    stored_offset = 0

    def __init__(self, layout: BlockLayout):
        self.layout = layout

    def __repr__(self) -> str:
        return f"PackedForm({self.layout.path!r}, {self.stored_nbytes} bytes)"

    @property
    def stored_nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def signature(self) -> str:
        return f"packed {self.layout.nbytes}"

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        return self.layout.copy_sources_into(stored, files, reader)

    def fill_range_(self, out: torch.Tensor, start: int) -> None:
        self.layout.copy_range_into(out, start)

    def slot_ops(self, slot_buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # the stored bytes are the compute layout already

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list:
        return []

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        lo, hi = max(start, stored_start), min(end, stored_start + stored.numel())
        if lo >= hi:
            return 0
        stored[lo - stored_start : hi - stored_start].copy_(slot_buffer[lo:hi])
        return hi - lo


def stored_region(form, slot_buffer: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """Where a form's stored bytes land in a slot (`nbytes` of them; default: the stored bytes)."""
    count = form.stored_nbytes if nbytes is None else nbytes
    return slot_buffer[form.stored_offset : form.stored_offset + count]


class SlotUnpack:
    """Turns the stored bytes in a slot into the block's compute layout (the float8 form's casts, the lossless
    form's decodes; nothing for the packed form), with the copies' views built once per slot. Runs on the thread (and stream) of the copy job,
    after the stored bytes are in the slot."""

    def __init__(self, form):
        self.form = form
        self._ops: dict[int, list[Upcast]] = {}

    def run_(self, slot_buffer: torch.Tensor) -> None:
        key = slot_buffer.data_ptr()
        ops = self._ops.get(key)
        if ops is None:
            with torch.inference_mode(False), torch.no_grad():  # views that stay usable in and out of inference mode
                ops = self._ops[key] = self.form.unpack_ops(slot_buffer)
        for op in ops:
            op.run_()  # on the device, in the copy's stream: upcast or decode (exact), or byte copy into place

    def clear_(self) -> None:
        self._ops.clear()  # the views keep the slots alive
