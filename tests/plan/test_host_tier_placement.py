"""The host tier of the placement (`host_budget_gb`): which streamed blocks live in host memory and which on
disk, decided once, as plain data (with the host pool that Wan 2.2's experts share); and `layerstream plan`
showing it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layerstream import OffloadPlan
from layerstream.plan.placement import place_blocks, spread_indices
from layerstream.plan.resolver import resolve_offload_plan
from test_placement import DIT_BLOCKS, ENCODER_BLOCKS, ToyDiT, ToyEncoder, ToyPipeline, _sizes

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

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
    # (what the disk read-ahead reads next is the streamer's prediction: test_disk_tier checks it follows the chain)
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
    # the two experts of Wan 2.2 share the host memory: a pool, no block held for the whole run
    assert tier["pool"]["entries"] and tier["disk_blocks"] and tier["host_blocks"] == []
    assert tier["host_bytes"] == tier["pool"]["bytes"] <= tier["budget_bytes"] == 100_000
    assert main(["plan", "tiny-wan", "--diffusion-offload-config", config]) == 0
    out = capsys.readouterr().out
    assert "host tier: host_budget_gb=0.0001 holds" in out and "on disk: transformer.blocks." in out
    assert "transformer_2: 0 blocks on the host (0 B), 1 in the host pool" in out
    assert "host pool: 1 entries" in out and "shared by transformer and transformer_2" in out


# --- the host pool of alternating DiTs (Wan 2.2's experts) ---------------------------------------------------


class WanPipeline(nn.Module):
    """Named as diffusers' class, so that the built-in Wan plan applies: two experts, one per step."""

    def __init__(self, num_blocks: int = 4, second_expert: bool = True, own_plan: bool = False):
        super().__init__()
        self.transformer = ToyDiT(num_blocks)
        self.transformer_2 = ToyDiT(num_blocks) if second_expert else None
        if own_plan:  # the pipeline describes transformer_2 itself: the built-in pairing no longer applies to it
            self._offload_plan = OffloadPlan(block_attrs={"transformer_2": ("blocks",)})


EXPERT_BLOCKS = [f"{e}.blocks.{i}" for e in ("transformer", "transformer_2") for i in range(4)]


def _wan_plan(budget_bytes: int, pipe=None, components=("dit",)):
    config = {"mode": "layer", "components": list(components), "host_budget_gb": budget_bytes / GB}
    return resolve_offload_plan(pipe if pipe is not None else WanPipeline(), config)


def test_wan_experts_share_a_host_pool_each_holding_what_the_budget_holds():
    plan = _wan_plan(3000)
    assert [c.alternates for c in plan.streamed] == [True, True]
    tier = place_blocks(plan, {p: 1000 for p in EXPERT_BLOCKS}).host_tier
    pool = tier.pool
    # three of each expert's four blocks, spread, share three entries: 3000 bytes, the budget
    assert pool.members == ("transformer", "transformer_2")
    picked = [EXPERT_BLOCKS[i] for i in spread_indices(4, 3)]
    assert pool.entries == tuple((p, p.replace("transformer.", "transformer_2.")) for p in picked)
    assert pool.nbytes == tier.host_nbytes == 3000 and tier.host_block_paths == ()
    assert spread_indices(4, 3) == [0, 2, 3]
    assert tier.disk_block_paths == ("transformer.blocks.1", "transformer_2.blocks.1")
    assert tier.pooled("transformer_2.blocks.2") and not tier.on_disk("transformer_2.blocks.2")
    assert set(tier.from_disk_paths) == set(EXPERT_BLOCKS)  # the disk store holds every pooled block's source
    assert pool.member_of("transformer_2.blocks.0") == "transformer_2" and pool.entry_of("transformer.blocks.3") == 2
    assert "share a host pool" in tier.reason and "holds no host memory" in tier.reason
    assert json.loads(json.dumps(tier.to_dict()))["pool"]["members"] == ["transformer", "transformer_2"]
    # without the pool the same budget held three blocks in all, one or two per expert
    static = place_blocks(_wan_plan(3000, WanPipeline(own_plan=True)), {p: 1000 for p in EXPERT_BLOCKS}).host_tier
    assert static.pool is None and len(static.host_block_paths) == 3


def test_no_pool_when_every_block_fits_or_there_is_one_expert():
    tier = place_blocks(_wan_plan(8000), {p: 1000 for p in EXPERT_BLOCKS}).host_tier
    assert tier.pool is None and len(tier.host_block_paths) == 8  # nothing would ever be read again
    one = WanPipeline(second_expert=False)  # Wan 2.1, or Wan 2.2 5B: transformer_2 is None
    tier = place_blocks(_wan_plan(2000, one), {p: 1000 for p in EXPERT_BLOCKS[:4]}).host_tier
    assert tier.pool is None and len(tier.host_block_paths) == 2


def test_budget_left_once_each_expert_fits_whole_keeps_the_first_entries_for_the_whole_run():
    tier = place_blocks(_wan_plan(6000), {p: 1000 for p in EXPERT_BLOCKS}).host_tier
    # the pool holds each expert whole (4000); the 2000 left keep blocks 0 and 1 of both for the whole run,
    # the blocks a newcomer needs first, so a change of expert reads two blocks instead of four
    assert tier.host_block_paths == tuple(f"{e}.blocks.{i}" for e in ("transformer", "transformer_2") for i in (0, 1))
    assert tier.pool.entries == tuple((f"transformer.blocks.{i}", f"transformer_2.blocks.{i}") for i in (2, 3))
    assert tier.disk_block_paths == () and tier.host_nbytes == 6000


def test_a_pool_entry_is_as_large_as_the_largest_block_sharing_it():
    sizes = {p: (1000 if p.startswith("transformer.") else 1500) for p in EXPERT_BLOCKS}
    tier = place_blocks(_wan_plan(3000), sizes).host_tier
    assert tier.pool.entry_nbytes == (1500, 1500) and tier.host_nbytes == 3000


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(64, 5000), min_size=8, max_size=8),
    encoder=st.lists(st.integers(64, 5000), min_size=3, max_size=3),
    budget=st.integers(1, 60_000),
)
def test_pooled_tiers_fit_the_budget_and_every_streamed_block_has_one_tier(sizes, encoder, budget):
    block_sizes = dict(zip(EXPERT_BLOCKS, sizes)) | {f"text_encoder.layers.{i}": n for i, n in enumerate(encoder)}

    class WithEncoder(WanPipeline):
        def __init__(self):
            super().__init__()
            self.text_encoder = ToyEncoder(3)
            self._offload_plan = OffloadPlan(encoder_component_types={"text_encoder": "text_encoder"}, encoder_block_attrs={"text_encoder": ("layers",)})

    placement = place_blocks(_wan_plan(budget, WithEncoder(), components=("dit", "text_encoder")), block_sizes)
    tier = placement.host_tier
    pool = tier.pool
    pooled = pool.block_paths if pool is not None else ()
    assert tier.host_nbytes == sum(block_sizes[p] for p in tier.host_block_paths) + (pool.nbytes if pool else 0) <= budget
    assert sorted(tier.host_block_paths + tier.disk_block_paths + pooled) == sorted(placement.streamed_block_paths)
    if pool is not None:
        assert not any(p.startswith("text_encoder.") for p in pooled)  # only the alternating DiTs share it
        for entry, nbytes in zip(pool.entries, pool.entry_nbytes):
            assert len({p.split(".")[0] for p in entry}) == len(entry) and nbytes == max(block_sizes[p] for p in entry)
