"""The float8 form of a block (`Float8Form`) in a slot and in its host buffer: neighbouring cast spans unpack as
one cast with every tensor exact, and the host tensors view the buffer itself when it is a slice of a larger
allocation."""

from __future__ import annotations

import pytest
import torch

from benchmark_modules import benchmark_module

benchmark_module("strategy_bench")  # benchmarks/ on sys.path, as the scripts have it

from strategy_bench.synthetic import ModelShape, build_synthetic_dit  # noqa: E402
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.float8 import Float8Form, float8_forms
from layerstream.runtime.forms.slot import SlotUnpack

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def wan_block_form() -> Float8Form:
    shape = ModelShape(name="wan/40", dim=128, num_heads=2, ffn_dim=352, block_kind="wan")
    model = build_synthetic_dit(shape, 1, dtype=torch.bfloat16)
    return float8_forms(model, torch.float8_e4m3fn).form(BlockLayout("blocks.0", model.blocks[0], CPU))


def test_a_blocks_neighbouring_cast_spans_unpack_as_one_cast_and_every_tensor_is_exact() -> None:
    """`Float8Form.slot_runs`: a Wan-shaped block's weights and biases unpack in a few casts (not one each), and
    every tensor of the block reads in the slot what the form's own host upcast gives it (raw spans byte for byte)."""
    form = wan_block_form()
    kinds = [s.kind for s in form.segments]
    assert kinds.count("cast") > 4 and len(form.slot_runs) < len(form.segments) / 2
    stored = torch.empty(form.stored_nbytes, dtype=torch.uint8)
    form.fill_(stored)
    slot = torch.full((form.slot_nbytes,), 0xFF, dtype=torch.uint8)  # NaN bytes wherever nothing writes
    slot[form.stored_offset : form.stored_offset + form.stored_nbytes].copy_(stored)
    SlotUnpack(form).run_(slot)
    expected = form.compute_bytes(stored)  # per segment, on the host: every span's bytes, zero between them
    for dst, length in form.layout.span_placements():
        assert torch.equal(slot[dst : dst + length], expected[dst : dst + length]), dst


def test_stored_tensors_view_a_buffer_that_is_a_slice_of_a_larger_allocation() -> None:
    """Host buffers are page-aligned slices of larger allocations (`page_aligned_empty`): the tensors
    `state_dict()` gives and `load_state_dict()` writes through (`Float8Form.stored_tensors`) must view the
    buffer's own bytes, not the allocation's first ones (they once did: the load wrote outside the buffer and
    `disable()` gave back the old weights)."""
    form = wan_block_form()
    allocation = torch.zeros(form.stored_nbytes + 1472, dtype=torch.uint8)
    stored = allocation[1472:]
    form.fill_(stored)
    compute = form.layout.separate_copies(form.compute_bytes(stored), CPU)
    tensors = form.stored_tensors(stored)
    assert len(tensors) == len(compute)
    for tensor, expected in zip(tensors, compute):
        assert tensor.data_ptr() >= stored.data_ptr()
        assert torch.equal(tensor.to(expected.dtype), expected)
    tensors[0].fill_(0.5)  # a write lands in the buffer: the compute bytes change, the bytes before it do not
    assert torch.equal(form.layout.separate_copies(form.compute_bytes(stored), CPU)[0], tensors[0].to(compute[0].dtype))
    assert not allocation[:1472].any()
