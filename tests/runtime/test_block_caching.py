"""Block-skipping caches on streamed models (issue 15, item 4).

A cache that skips blocks (cache-dit's DBCache, first-block caches, TeaCache-like hooks) never calls them, so
the streamer sees a different order on cached steps. It must absorb that: outputs stay bit-identical to the
resident model under the same cache, a skipped block's prefetched copy stays in its slot for its next run
(re-copied at most once per skip streak, never once per skipped call), the learned order survives occasional
skips (`RELEARN_AFTER`), and a block that runs unpredicted is loaded synchronously (`num_sync_loads`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from layerstream import enable_offload
from runtime_toys import run, tiny_wan_transformer
from tiny_pipelines import DIT, KINDS, generate, load


class SkippingBlocks(nn.ModuleList):
    """A TeaCache-like hook of the test's own: on the calls `skip_on` names, the blocks after the first are not
    run at all (their cached residual is added instead, as a cache would)."""

    def __init__(self, blocks: nn.ModuleList):
        super().__init__(blocks)
        self.call = -1
        self.skip_on: set[int] = set()
        self.num_runs = [0] * len(blocks)

    def __iter__(self):
        self.call += 1
        skipping = self.call in self.skip_on
        for i, block in enumerate(super().__iter__()):
            if skipping and i > 0:
                continue
            self.num_runs[i] += 1
            yield block


def _with_skipping_blocks(model):
    model.blocks = SkippingBlocks(model.blocks)
    return model


def test_skipped_blocks_keep_the_order_reuse_their_prefetched_copy_and_match_the_resident_model():
    model, inputs = tiny_wan_transformer()
    resident, streamed = _with_skipping_blocks(copy.deepcopy(model)), _with_skipping_blocks(model)
    handle = enable_offload(streamed, DIT, device="cpu")
    num_calls = 12
    skip_on = {2, 3, 4, 7, 10}  # streaks of skipped calls and single ones
    for blocks in (resident.blocks, streamed.blocks):
        blocks.skip_on, blocks.call, blocks.num_runs = skip_on, -1, [0] * len(blocks)  # enabling iterated the list
    for _ in range(num_calls):
        assert torch.equal(run(streamed, inputs), run(resident, inputs))

    streamer = handle.streamer
    # the declared order 0 -> 1 -> 2 -> 0 is still what is predicted: single skips did not unlearn it
    assert [b.next_index for b in streamer.blocks] == [1, 2, 0]
    stats = handle.stats()
    runs = streamed.blocks.num_runs
    assert runs == [num_calls, num_calls - len(skip_on), num_calls - len(skip_on)]
    transfers = handle.block_transfers()
    # block 1 was prefetched before each skip streak and stayed in its slot through it: one copy per run at most
    assert transfers["blocks.1"] <= runs[1] + 1
    # block 0 runs after itself on skipped calls; it is still in its slot then, so no copy and no sync load
    assert stats.num_sync_loads <= 1 + len(skip_on)
    assert stats.max_materialized_blocks == 1
    handle.disable()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_cache_dit_skips_blocks_of_a_streamed_pipeline_and_matches_the_resident_pipeline(kind):
    cache_dit = pytest.importorskip("cache_dit")
    resident, streamed = load(kind), load(kind)
    handle = enable_offload(streamed, DIT, device="cpu")
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1, residual_diff_threshold=10.0, max_cached_steps=-1
    )  # a threshold no step exceeds: every step after the warmup skips all blocks but the first
    for pipe in (resident, streamed):
        cache_dit.enable_cache(pipe, cache_config=config)
    assert torch.equal(generate(streamed, kind, num_inference_steps=6), generate(resident, kind, num_inference_steps=6))
    stats = handle.stats()
    transfers = handle.block_transfers()
    for path, num in transfers.items():
        first = path.rsplit(".", 1)[0] + ".0"
        assert num <= transfers[first], path  # a skipped block is not copied again for every skipped step
    assert stats.max_materialized_blocks <= stats.num_slots
    handle.disable()


@pytest.mark.slow
def test_cache_dit_disabled_again_leaves_a_streamed_pipeline_that_matches_resident():
    """enable_cache, generate, disable_cache, generate: the second picture (no block skipped any more) equals
    the resident pipeline's after the same sequence."""
    cache_dit = pytest.importorskip("cache_dit")
    resident, streamed = load("wan"), load("wan")
    handle = enable_offload(streamed, DIT, device="cpu")
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1, residual_diff_threshold=10.0, max_cached_steps=-1
    )
    outputs = []
    for pipe in (resident, streamed):
        cache_dit.enable_cache(pipe, cache_config=config)
        cached = generate(pipe, "wan", num_inference_steps=3)
        cache_dit.disable_cache(pipe)
        outputs.append((cached, generate(pipe, "wan", num_inference_steps=3)))
    (resident_cached, resident_plain), (streamed_cached, streamed_plain) = outputs
    assert torch.equal(streamed_cached, resident_cached) and torch.equal(streamed_plain, resident_plain)
    assert not torch.equal(resident_plain, resident_cached)  # the cache did skip blocks the plain run computes
    handle.disable()
