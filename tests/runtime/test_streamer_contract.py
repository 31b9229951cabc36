"""The streamer's scheduling contract: prefetch depth D keeps the next D blocks in slots while a block runs, and
blocks run out of order cost exactly the synchronous loads of the least-recently-used policy."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from runtime_toys import ToyDiT, run

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

NUM_BLOCKS = 6


def _config(depth: int) -> dict:
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"prefetch_depth": depth}}}


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_while_block_i_runs_blocks_i_plus_1_to_i_plus_depth_own_slots(depth):
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=NUM_BLOCKS).eval()
    x = torch.randn(2, 3, 16)
    expected = run(model, (x,))
    handle = enable_offload(model, _config(depth), device="cpu")
    streamer = handle.streamer
    by_path = {b.path: b for b in streamer.blocks}
    chain = [by_path[f"blocks.{i}"] for i in range(NUM_BLOCKS)]
    seen = []

    def check(i: int) -> None:
        running = chain[i]
        ahead = [chain[(i + k) % NUM_BLOCKS] for k in range(1, depth + 1)]  # along the chain, wrapping
        missing = [b.path for b in ahead if b.slot is None]
        assert not missing, f"while {running.path} runs (depth {depth}), {missing} own no slot"
        owned = [b.slot for b in [running, *ahead]]
        assert len(set(owned)) == depth + 1  # each in a slot of its own
        assert streamer.slot_in_use[running.slot] and streamer.num_materialized == 1
        seen.append(i)

    hooks = [chain[i].module.register_forward_pre_hook(lambda m, a, i=i: check(i)) for i in range(NUM_BLOCKS)]
    for _ in range(3):  # the wrap-around too: the last block prefetches the first ones of the next forward
        assert torch.equal(run(model, (x,)), expected)
    assert seen == list(range(NUM_BLOCKS)) * 3
    stats = handle.stats()
    assert stats.num_slots == depth + 1 and stats.max_materialized_blocks == 1
    assert stats.num_sync_loads == 1  # only block 0 of the first forward: everything else was prefetched
    for h in hooks:
        h.remove()
    handle.disable()


def test_out_of_order_blocks_at_depth_two_cost_the_lru_number_of_sync_loads():
    """Four blocks, depth 2 (3 slots). Forward 1 runs 0 1 2 3, forward 2 runs 2 1 0 2 0.

    Hand trace (`least recently used` counts both a copy issued into a slot and a block run from it):
      forward 1: 0 is cold (sync load 1) and prefetches 1 and 2; 1 prefetches 3 over 0; 2 prefetches 0 over 1;
        3 prefetches 1 over 2. The slots hold 3, 0, 1; the one holding 0 is the least recently used.
      forward 2: 2 is not in a slot (sync load 2): it is loaded over the least recently used slot, 0's, and
        prefetches its learned successor 3, already there. 1 is still in its slot. 0 is gone (sync load 3):
        loaded over the least recently used slot, 3's. Then 2 and 0 are both in slots.
    Evicting the most recently used slot instead costs 5 sync loads; always the first free slot, 4."""
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4).eval()
    x = torch.randn(2, 3, 16)
    orders = [[0, 1, 2, 3], [2, 1, 0, 2, 0]]
    expected = []
    for order in orders:
        model.order = order
        expected.append(run(model, (x,)))
    handle = enable_offload(model, _config(2), device="cpu")
    for order, want in zip(orders, expected):
        model.order = order
        assert torch.equal(run(model, (x,)), want)
    assert handle.stats().num_sync_loads == 3
    compute = handle.trace().lane("compute")
    assert [i.label for i in compute] == [f"blocks.{i}" for order in orders for i in order]
    assert [i.label for i in compute if i.sync_load] == ["blocks.0", "blocks.2", "blocks.0"]
    handle.disable()
