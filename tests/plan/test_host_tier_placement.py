"""The host tier of the placement (`host_budget_gb`): which streamed blocks live in host memory and which on
disk, decided once, as plain data; and `layerstream plan` showing it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerstream.plan.placement import place_blocks, spread_indices
from layerstream.plan.resolver import resolve_offload_plan
from test_placement import DIT_BLOCKS, ENCODER_BLOCKS, ToyPipeline, _sizes

GB = 1e9


def _plan(host_budget_bytes: int | None, components=("dit",), **dit):
    config = {"mode": "layer", "components": list(components), "layer_options": {"dit": dit}}
    if host_budget_bytes is not None:
        config["host_budget_gb"] = host_budget_bytes / GB
    return resolve_offload_plan(ToyPipeline(), config)


def test_without_a_budget_every_block_is_on_the_host_and_nothing_is_reported():
    placement = place_blocks(_plan(None), _sizes())
    assert placement.host_tier is None
    assert "host_tier" not in placement.to_dict()


def test_a_budget_holding_every_block_puts_nothing_on_disk():
    tier = place_blocks(_plan(10_000), _sizes()).host_tier
    assert tier.host_block_paths == tuple(DIT_BLOCKS) and tier.disk_block_paths == ()
    assert tier.host_nbytes == sum(_sizes()[p] for p in DIT_BLOCKS)
    assert "holds every streamed block" in tier.reason


def test_host_blocks_are_a_fixed_set_spread_through_the_chain():
    sizes = {p: 1000 for p in DIT_BLOCKS}
    tier = place_blocks(_plan(3000), sizes).host_tier
    # three of six: every other block, so each disk read follows a host block whose compute hides it
    assert tier.host_block_paths == tuple(DIT_BLOCKS[i] for i in spread_indices(6, 3)) == tuple(DIT_BLOCKS[1::2])
    assert tier.disk_block_paths == tuple(DIT_BLOCKS[0::2])
    assert tier.host_nbytes == 3000 == tier.budget_nbytes
    assert "fixed set spread through each chain" in tier.reason and "host_budget_gb=3e-06" in tier.reason
    assert tier.on_disk(DIT_BLOCKS[0]) and not tier.on_disk(DIT_BLOCKS[1])
    # what a disk read-ahead reads next: the chain's next disk block, cyclic (the last one runs before the first)
    assert dict(tier.next_on_disk) == {DIT_BLOCKS[0]: DIT_BLOCKS[2], DIT_BLOCKS[2]: DIT_BLOCKS[4], DIT_BLOCKS[4]: DIT_BLOCKS[0]}
    # the choice is plain data that `layerstream plan --json` prints
    assert json.loads(json.dumps(place_blocks(_plan(3000), sizes).to_dict()))["host_tier"] == tier.to_dict()


def test_a_budget_below_every_block_puts_every_block_on_disk():
    tier = place_blocks(_plan(500), _sizes()).host_tier
    assert tier.host_block_paths == () and tier.disk_block_paths == tuple(DIT_BLOCKS) and tier.host_nbytes == 0


def test_the_budget_is_shared_evenly_between_chains():
    plan = _plan(3000, components=("dit", "text_encoder"))
    sizes = {**{p: 500 for p in DIT_BLOCKS}, **{p: 500 for p in ENCODER_BLOCKS}}
    tier = place_blocks(plan, sizes).host_tier
    on_host = set(tier.host_block_paths)
    # 6 of 9 blocks fit: 4 of the 6 DiT blocks and 2 of the 3 encoder layers (two thirds of each chain)
    assert len(on_host & set(DIT_BLOCKS)) == 4 and len(on_host & set(ENCODER_BLOCKS)) == 2


def test_resident_blocks_are_not_counted_against_the_host_budget():
    placement = place_blocks(_plan(2000, resident_layers=2), {p: 1000 for p in DIT_BLOCKS})
    tier = placement.host_tier
    assert set(tier.host_block_paths) | set(tier.disk_block_paths) == set(DIT_BLOCKS[2:])
    assert len(tier.host_block_paths) == 2


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(64, 5000), min_size=6, max_size=6), budget=st.integers(1, 40_000))
def test_host_blocks_fit_the_budget_and_every_streamed_block_has_one_tier(sizes, budget):
    block_sizes = dict(zip(DIT_BLOCKS, sizes))
    placement = place_blocks(_plan(budget), block_sizes)
    tier = placement.host_tier
    assert tier.host_nbytes == sum(block_sizes[p] for p in tier.host_block_paths) <= budget
    assert set(tier.host_block_paths).isdisjoint(tier.disk_block_paths)
    assert sorted(tier.host_block_paths + tier.disk_block_paths) == sorted(placement.streamed_block_paths)


def test_plan_cli_shows_the_host_tier(capsys):
    from layerstream.cli.main import main

    config = json.dumps({"mode": "layer", "components": ["dit"], "host_budget_gb": 1e-4})
    assert main(["plan", "tiny-wan", "--json", "--diffusion-offload-config", config]) == 0
    tier = json.loads(capsys.readouterr().out)["placement"]["host_tier"]
    assert tier["host_blocks"] and tier["disk_blocks"] and tier["host_bytes"] <= tier["budget_bytes"] == 100_000
    assert main(["plan", "tiny-wan", "--diffusion-offload-config", config]) == 0
    out = capsys.readouterr().out
    assert "host tier: host_budget_gb=0.0001 holds" in out and "on disk: transformer.blocks." in out
