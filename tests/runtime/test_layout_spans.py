"""Span placement of `BlockLayout`, asserted directly: each storage span of a block lands in the packed buffer at
an offset with the address residue (mod ALIGN_BYTES) its tensors have where they already live on the target
device, and at residue 0 where they do not (a fresh allocation there starts aligned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


class ViewsBlock(nn.Module):
    """Parameters and buffers viewing a few storages at odd element offsets, in several dtypes."""

    def __init__(self):
        super().__init__()
        base = torch.randn(4096)
        self.a = nn.Parameter(base[3:67].view(8, 8))  # byte 12 of the storage
        self.b = nn.Parameter(base[1001:1065].view(8, 8).T)  # same storage, transposed view
        half = torch.randn(301).half()
        self.h = nn.Parameter(half[5:105])  # byte 10 of a second storage
        bf16 = torch.randn(77).bfloat16()
        self.register_buffer("g", bf16[33:57])  # byte 66 of a third: residue 2
        self.own = nn.Parameter(torch.randn(5, 3))  # a storage of its own, from its start
        self.register_buffer("ints", torch.arange(40, dtype=torch.int64)[7:17])  # byte 56 of a fourth
        self.register_buffer("tail", base[4000:4090])  # the first storage again, far away


def _tensor_of(entry) -> torch.Tensor:
    owner = entry.module._parameters if entry.is_param else entry.module._buffers
    return owner[entry.name]


def _span_starts(layout: BlockLayout) -> list[tuple[int, int]]:
    """(source byte start inside its storage, destination offset in the buffer) of every span."""
    return [(start, dst) for _, start, _, dst in layout._spans]


def _check_packing(layout: BlockLayout) -> None:
    """Spans lie inside the buffer without overlapping, and every entry sits inside its span where it sat
    inside its storage."""
    spans = sorted((dst, dst + length) for _, _, length, dst in layout._spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.nbytes and layout.nbytes % ALIGN_BYTES == 0
    starts = _span_starts(layout)
    for e in layout.entries:
        t = _tensor_of(e)
        src_start, dst = starts[e.span_index]
        assert e.element_offset * t.element_size() - dst == t.storage_offset() * t.element_size() - src_start, e.name


def test_spans_keep_their_address_residue_when_the_source_lives_on_the_target_device():
    torch.manual_seed(0)
    block = ViewsBlock()
    layout = BlockLayout("block", block, CPU)
    assert len(layout._spans) == 5  # one span per storage: the shared one once
    for (source, start, _, dst), residue in zip(layout._spans, layout.span_residues):
        address = source.untyped_storage().data_ptr() + start
        assert residue == address % ALIGN_BYTES
        assert dst % ALIGN_BYTES == residue
    assert sorted(set(layout.span_residues)) != [0], "the block must exercise non-zero residues"
    # so every tensor, read from an aligned buffer, sits at the residue it has now: what CPU kernels see
    for e in layout.entries:
        t = _tensor_of(e)
        assert (e.element_offset * t.element_size()) % ALIGN_BYTES == t.data_ptr() % ALIGN_BYTES, e.name
    _check_packing(layout)
    buffer = torch.empty(layout.nbytes + ALIGN_BYTES, dtype=torch.uint8)
    shift = (-buffer.data_ptr()) % ALIGN_BYTES
    aligned = buffer[shift : shift + layout.nbytes]
    layout.copy_sources_into(aligned)
    for e, view in zip(layout.entries, layout.views(aligned)):
        t = _tensor_of(e)
        assert view.data_ptr() % ALIGN_BYTES == t.data_ptr() % ALIGN_BYTES, e.name
        assert (view.shape, view.stride(), view.dtype) == (t.shape, t.stride(), t.dtype) and torch.equal(view, t)


@pytest.mark.parametrize("target", [torch.device("cuda", 0), torch.device("meta"), None], ids=str)
def test_spans_start_aligned_when_the_source_lives_elsewhere(target):
    torch.manual_seed(0)
    block = ViewsBlock()
    layout = BlockLayout("block", block, target)  # computing a layout moves nothing and needs no device
    assert layout.span_residues == [0] * len(layout._spans)
    assert all(dst % ALIGN_BYTES == 0 for _, dst in _span_starts(layout))
    _check_packing(layout)
