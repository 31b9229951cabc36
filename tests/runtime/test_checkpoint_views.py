"""Streamed blocks whose weights are lazy views of a safetensors file are read straight from the file into the
host store, and come back with the exact structure they had: a weight tied between two modules of a block, a
transposed (non-contiguous) weight and two weights sliced out of one fused tensor all stream bit-identically
and are read from the file, not faulted in through the mapping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

safetensors_torch = pytest.importorskip("safetensors.torch")

from layerstream import OffloadPlan, enable_offload  # noqa: E402

DIM = 64


class ViewBlock(nn.Module):
    """A block whose weights are views: `a` and `b` share one tied Linear weight, `proj_t` holds a transposed
    view, and `q`/`k` are two slices of one fused tensor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, DIM, bias=False)
        self.b = nn.Linear(DIM, DIM, bias=False)
        self.proj_t = nn.Linear(DIM, 2 * DIM, bias=False)
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.a(x) + self.b(torch.tanh(x))
        h = self.proj_t(h)[..., :DIM] + self.q(h) * torch.sigmoid(self.k(h))
        return x + h


class ViewStack(nn.Module):
    def __init__(self, num_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(ViewBlock() for _ in range(num_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ViewPipeline(nn.Module):
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})

    def __init__(self, transformer: ViewStack):
        super().__init__()
        self.transformer = transformer


def _write_checkpoint(path: Path, num_blocks: int) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(num_blocks):
        tensors[f"{i}.tied"] = torch.randn(DIM, DIM, generator=g) / DIM**0.5
        tensors[f"{i}.proj_t"] = torch.randn(DIM, 2 * DIM, generator=g) / DIM**0.5  # stored as (in, out)
        tensors[f"{i}.qk"] = torch.randn(2 * DIM, DIM, generator=g) / DIM**0.5
        tensors[f"{i}.qk_bias"] = torch.randn(2 * DIM, generator=g)
    safetensors_torch.save_file(tensors, str(path))


def _stack_viewing(path: Path, num_blocks: int) -> ViewStack:
    """A stack whose weights are views of the file's lazy mapping, as a loader would leave them."""
    weights = safetensors_torch.load_file(str(path))
    stack = ViewStack(num_blocks).eval()
    for i, block in enumerate(stack.blocks):
        tied = nn.Parameter(weights[f"{i}.tied"])
        block.a.weight = tied
        block.b.weight = tied
        block.proj_t.weight = nn.Parameter(weights[f"{i}.proj_t"].t())  # (out, in), non-contiguous
        qk, qk_bias = weights[f"{i}.qk"], weights[f"{i}.qk_bias"]
        block.q.weight, block.k.weight = nn.Parameter(qk[:DIM]), nn.Parameter(qk[DIM:])
        block.q.bias, block.k.bias = nn.Parameter(qk_bias[:DIM]), nn.Parameter(qk_bias[DIM:])
    return stack


def test_tied_transposed_and_fused_views_of_a_file_stream_bit_identically(tmp_path: Path):
    num_blocks = 3
    path = tmp_path / "stack.safetensors"
    _write_checkpoint(path, num_blocks)
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _stack_viewing(path, num_blocks)(x)

    stack = _stack_viewing(path, num_blocks)
    block = stack.blocks[0]
    assert block.a.weight is block.b.weight and not block.proj_t.weight.is_contiguous()
    pipe = ViewPipeline(stack)
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
    stats = handle.stats()
    file_bytes = path.stat().st_size
    # every streamed weight came from the file (the header is the only part of the file not read)
    assert 0.9 * file_bytes <= stats.host_bytes_from_files <= file_bytes, (stats.host_bytes_from_files, file_bytes)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(stack(x), expected)
    assert block.a.weight is block.b.weight  # still one Parameter, bound to one place in the slot
    handle.disable()
    assert block.a.weight is block.b.weight and not block.proj_t.weight.is_contiguous()
    assert block.proj_t.weight.stride() == (1, 2 * DIM)
    assert block.q.weight.untyped_storage().data_ptr() == block.k.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(stack(x), expected)
