"""The ideal forward, the transfer floor and the link chosen for a ratio."""

from __future__ import annotations

import pytest

from benchmark_modules import benchmark_module

benchmark_module("strategy_bench")  # benchmarks/ on sys.path, as the scripts have it

from strategy_bench.harness import default_auto_budget_gb  # noqa: E402
from layerstream.timing import ideal

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_every_block_streamed_pairs_each_transfer_with_the_compute_beside_it():
    compute = [1.0, 2.0, 1.0]
    transfer = [1.5, 1.5, 1.5]
    # block i's copy runs during block i-1's compute (block 0's during the last block's)
    expected = 0.25 + max(1.0, 1.5) + max(1.0, 1.5) + max(2.0, 1.5)
    assert ideal.ideal_forward_seconds(compute, transfer, other_s=0.25) == pytest.approx(expected)
    assert ideal.transfer_floor_seconds(transfer) == pytest.approx(4.5)


def test_resident_blocks_hide_the_next_streamed_transfer():
    compute = [1.0, 1.0, 3.0, 1.0]
    transfer = [2.0, 0.0, 5.0, 0.0]  # blocks 1 and 3 stay resident
    # block 2's copy is issued when block 0 starts: it hides behind blocks 0 and 1; block 0's behind 2 and 3
    expected = max(1.0 + 1.0, 5.0) + max(3.0 + 1.0, 2.0)
    assert ideal.ideal_forward_seconds(compute, transfer) == pytest.approx(expected)


def test_no_streamed_block_is_the_resident_time_and_one_is_hidden_by_all():
    assert ideal.ideal_forward_seconds([1.0, 2.0], [0.0, 0.0], other_s=0.5) == pytest.approx(3.5)
    assert ideal.ideal_forward_seconds([1.0, 2.0, 3.0], [0.0, 4.0, 0.0]) == pytest.approx(6.0)
    assert ideal.ideal_forward_seconds([1.0, 2.0, 3.0], [0.0, 9.0, 0.0]) == pytest.approx(9.0)


def test_ideal_is_compute_when_the_link_is_fast_and_transfer_when_slow():
    compute = [0.01] * 4
    assert ideal.ideal_forward_seconds(compute, [0.005] * 4) == pytest.approx(0.04)  # ratio 0.5: resident time
    assert ideal.ideal_forward_seconds(compute, [0.02] * 4) == pytest.approx(0.08)  # ratio 2: the floor
    assert ideal.ideal_forward_seconds(compute, [0.02] * 4, other_s=-1.0) == pytest.approx(0.08)  # noise never helps


def test_link_for_ratio_round_trips_to_the_transfer_time():
    block_bytes, compute_s = 40_000_000, 0.010
    for ratio in (0.5, 1.0, 2.0):
        gbps = ideal.link_gbps_for_ratio(block_bytes, compute_s, ratio)
        assert ideal.transfer_seconds(block_bytes, gbps) == pytest.approx(ratio * compute_s)
    assert ideal.link_gbps_for_ratio(1_000_000_000, 1.0, 2.0) == pytest.approx(0.5)


def test_block_transfer_seconds_zero_for_resident_blocks():
    times = ideal.block_transfer_seconds([1e9, 2e9, 1e9], [True, False, True], link_gbps=10.0)
    assert times == pytest.approx([0.1, 0.0, 0.1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: ideal.transfer_seconds(10, 0.0),
        lambda: ideal.link_gbps_for_ratio(10, 1.0, 0.0),
        lambda: ideal.link_gbps_for_ratio(10, 0.0, 1.0),
        lambda: ideal.ideal_forward_seconds([1.0], [1.0, 2.0]),
        lambda: ideal.block_transfer_seconds([1], [True, False], 1.0),
    ],
)
def test_invalid_inputs_are_rejected(call):
    with pytest.raises(ValueError):
        call()


def test_default_auto_budget_leaves_room_for_half_the_blocks():
    block = 1_000_000
    ring = 2 * (block + 64)  # two slots, each as the placement sizes it (aligned packed bytes)
    budget = default_auto_budget_gb(model_bytes=8 * block + 500_000, block_bytes=[block] * 8, ring_nbytes=ring)
    # non-block 0.5 MB + the ring + 4 blocks: no slack, the ring is the placement's own figure
    assert budget == pytest.approx((500_000 + ring + 4 * block) / 1e9)


def test_disk_reads_hide_behind_the_host_blocks_since_the_previous_disk_block():
    compute = [1.0, 1.0, 1.0, 1.0]
    transfer = [0.5, 0.5, 0.5, 0.5]
    disk = [0.0, 1.5, 0.0, 2.5]  # blocks 1 and 3 are read from disk; 0 and 2 are in host memory
    # block 1's read runs beside blocks 0 and 1 (segment 3 -> 1), block 3's beside blocks 2 and 3
    expected = 0.25 + max(1.0 + 1.0, 1.5) + max(1.0 + 1.0, 2.5)
    assert ideal.ideal_forward_seconds_with_disk(compute, transfer, disk, other_s=0.25) == pytest.approx(expected)
    assert ideal.transfer_floor_seconds(disk) == pytest.approx(4.0)


def test_every_block_on_disk_costs_the_longest_of_its_three_stages():
    compute = [1.0, 2.0, 1.0]
    transfer = [1.5, 0.5, 0.5]
    disk = [0.5, 1.0, 3.0]
    # block i's copy and read run beside block i-1's compute (block 0's beside the last block's)
    expected = max(1.0, 1.5, 0.5) + max(1.0, 0.5, 1.0) + max(2.0, 0.5, 3.0)
    assert ideal.ideal_forward_seconds_with_disk(compute, transfer, disk) == pytest.approx(expected)


def test_a_slow_disk_makes_the_ideal_its_floor_and_no_disk_block_the_plain_ideal():
    compute, transfer = [0.01] * 8, [0.002] * 8
    half = [0.0, 0.04] * 4  # every other block on disk, each read twice the compute of the two blocks it hides behind
    assert ideal.ideal_forward_seconds_with_disk(compute, transfer, half) == pytest.approx(ideal.transfer_floor_seconds(half))
    fast = [0.0, 0.005] * 4
    assert ideal.ideal_forward_seconds_with_disk(compute, transfer, fast) == pytest.approx(0.08)  # resident time
    assert ideal.ideal_forward_seconds_with_disk(compute, transfer, [0.0] * 8) == ideal.ideal_forward_seconds(compute, transfer)


def test_disk_seconds_and_invalid_disk_inputs():
    assert ideal.block_transfer_seconds([2_000_000, 4_000_000], [False, True], 2.0) == [0.0, pytest.approx(0.002)]
    with pytest.raises(ValueError, match="must stream"):
        ideal.ideal_forward_seconds_with_disk([1.0, 1.0], [0.0, 1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="one per block"):
        ideal.ideal_forward_seconds_with_disk([1.0], [1.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        ideal.block_transfer_seconds([1], [True], 0.0)
