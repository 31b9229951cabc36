"""The sharded store keeps a float8 component's blocks in their float8 form (`weight_transfer: "allgather"` with
`storage_dtype`), in one process: over a group of one the local float8 store serves (plain copies), the sharded
store itself (a gloo group of one, through `store_factory`) gives the float8 output bit for bit, and a rank keeps
exactly its window of what a forward writes. Two ranks: tests/distributed/test_float8_allgather.py."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.float8 import float8_forms
from runtime_toys import make_my_pipeline, run, snapshot, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
FP8 = "float8_e4m3fn"


def _config(transfer: str) -> dict:
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": FP8, "weight_transfer": transfer}}}


def _float8_in_one_process() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _config("rank-local"), device="cpu")
    out = run(pipe, toy_inputs())
    handle.disable()
    return out, snapshot(pipe)


def test_allgather_over_a_group_of_one_is_the_local_float8_store(gloo_group_of_one):
    expected, _ = _float8_in_one_process()
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _config("allgather"), device="cpu")
    assert {(type(b.host).__name__, type(b.host.form).__name__) for b in handle.streamer.blocks} == {("LocalBlock", "Float8Form")}
    assert torch.equal(run(pipe, toy_inputs()), expected)
    handle.disable()


def test_the_sharded_store_gathers_float8_bytes_and_casts_them_in_the_slot(gloo_group_of_one):
    from layerstream.distributed.collectives import BlockGather
    from layerstream.distributed.process_group import GroupMembership
    from layerstream.distributed.sharded_store import ShardedHostStore

    expected, expected_weights = _float8_in_one_process()
    pipe = make_my_pipeline()
    forms = float8_forms(pipe.transformer, torch.float8_e4m3fn)
    store = ShardedHostStore(BlockGather("MyPipeline", GroupMembership(None, 0, 1, "gloo", CPU)), forms.form)
    paths = [f"transformer.blocks.{i}" for i in range(len(pipe.transformer.blocks))]
    stored = {p: forms.form(BlockLayout(p, b, CPU)).stored_nbytes for p, b in zip(paths, pipe.transformer.blocks)}
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu", store_factory=lambda path: store)
    for _ in range(2):
        assert torch.equal(run(pipe, toy_inputs()), expected)
    assert {b.path: b.host.host_bytes for b in handle.streamer.blocks} == stored  # float8 bytes (one rank: all)
    assert handle.stats().host_bytes == sum(stored.values())
    handle.disable()
    after = snapshot(pipe)
    assert all(torch.equal(after[k], v) for k, v in expected_weights.items())  # the float8-rounded weights


def test_a_rank_keeps_its_window_of_what_a_forward_writes_in_float8():
    """`write_slot_range_` into windows of the stored bytes (a rank's shard) writes what the whole-block write
    does, each window its own part."""
    pipe = make_my_pipeline()
    block = pipe.transformer.blocks[0]
    form = float8_forms(pipe.transformer, torch.float8_e4m3fn).form(BlockLayout("b", block, CPU))
    compute = torch.randint(0, 256, (form.layout.nbytes,), dtype=torch.uint8)
    compute.view(torch.float32)[:] = torch.randn(form.layout.nbytes // 4)  # finite values everywhere
    whole = torch.zeros(form.stored_nbytes, dtype=torch.uint8)
    start, end = 100, form.layout.nbytes - 300  # a range cutting through spans
    written = form.write_slot_range_(whole, 0, compute, start, end)
    assert written > 0
    half = -(-form.stored_nbytes // 2)
    windows = [torch.zeros(half, dtype=torch.uint8), torch.zeros(half, dtype=torch.uint8)]
    in_windows = sum(form.write_slot_range_(w, k * half, compute, start, end) for k, w in enumerate(windows))
    assert in_windows == written
    assert torch.equal(torch.cat(windows)[: form.stored_nbytes], whole)
