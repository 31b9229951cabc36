"""The packed form of a block (`contracts.StoredForm`): its bytes kept as its packed layout, byte for byte."""

from __future__ import annotations

import torch

from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout


class PackedForm:
    """A block kept as its packed layout: the stored bytes are the compute layout, nothing to unpack."""

    lossless = True
    stored_is_packed = True
    coded = False
    stored_offset = 0

    def __init__(self, layout: BlockLayout):
        self.layout = layout

    def __repr__(self) -> str:
        return f"PackedForm({self.layout.path!r}, {self.stored_nbytes} bytes)"

    @property
    def stored_nbytes(self) -> int:
        return self.layout.nbytes

    slot_nbytes = stored_nbytes  # the slot holds the packed layout alone, nothing to unpack into

    @property
    def signature(self) -> str:
        return f"packed {self.layout.nbytes}"

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        return self.layout.copy_sources_into(stored, files, reader)

    def fill_range_(self, out: torch.Tensor, start: int) -> None:
        self.layout.copy_range_into(out, start)

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list:
        return []  # the stored bytes are the compute layout already

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def compute_range(self, stored: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
        return stored[start : start + nbytes]  # a view of the store's bytes

    def stored_tensors(self, stored: torch.Tensor) -> list[torch.Tensor]:
        return self.layout.views(stored)

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        lo, hi = max(start, stored_start), min(end, stored_start + stored.numel())
        if lo >= hi:
            return 0
        stored[lo - stored_start : hi - stored_start].copy_(slot_buffer[lo:hi])
        return hi - lo
