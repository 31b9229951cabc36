"""Where a form's stored bytes land in a device slot, and the unpacking that turns them into the block's compute
layout there (`SlotUnpack`: the float8 form's casts, the lossless form's decodes; nothing for the packed form)."""

from __future__ import annotations

from typing import Protocol

import torch


class SlotOp(Protocol):
    """One step of a form's unpacking in a slot (`Upcast`, `SpanDecode`): planned once on views of the slot."""

    def run_(self) -> object: ...


def stored_region(form, slot_buffer: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """Where a form's stored bytes land in a slot (`nbytes` of them; default: the stored bytes)."""
    count = form.stored_nbytes if nbytes is None else nbytes
    return slot_buffer[form.stored_offset : form.stored_offset + count]


class SlotUnpack:
    """Runs a form's unpacking in a slot, with its views built once per slot. Runs on the thread (and stream) of
    the copy job, after the stored bytes are in the slot."""

    def __init__(self, form):
        self.form = form
        self._ops: dict[int, list[SlotOp]] = {}

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
