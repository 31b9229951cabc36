"""`weight_transfer: "allgather"` with `host_budget_gb`: each rank keeps its shards within its own budget in host
memory and the rest through the disk tier (spill files or the checkpoint's ranges in its shard, the staging
ring, the host pool of alternating DiTs), gathered into the slot from there. 2 gloo ranks on loopback, one
launch for every check."""

from __future__ import annotations

import importlib.util

import pytest

from dist_harness import AGREEMENT_TIMEOUT_S, raise_rank_errors, run_ranks

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("ranks")

# what else grows at a first enable beside the store: lazily imported modules (the disk tier, the codecs), the
# allocator's arenas; measured 1.2 MB over the accounted bytes in the full suite (a weak bound on a 313 KB model)
RSS_SLACK_BYTES = 2 * 2**20
"""VmRSS also moves by allocator and thread-stack pages beside the store's own bytes (measured: 30-60 KB above
them on tiny Wan, whose blocks are 52 KB)."""


def _gguf_expert(folder, path) -> str:
    """Tiny Wan 2.2's low-noise expert as a GGUF file (Q4_0 and Q8_0 blocks, the original key names), written
    once here for both ranks."""
    from diffusers import WanTransformer3DModel

    from tests.models.single_files import wan_original_keys, write_gguf

    state = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer_2").state_dict()
    write_gguf(path, wan_original_keys(state), {".ffn.": "Q8_0", "": "Q4_0"})
    return str(path)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from layerstream.models.tiny import ensure_tiny_model

    folder = ensure_tiny_model("tiny-wan")  # built here, once: two ranks building it into one cache would race
    tmp_path = tmp_path_factory.mktemp("allgather-budget")
    gguf_expert = _gguf_expert(folder, tmp_path / "low.gguf") if importlib.util.find_spec("gguf") else None
    results = run_ranks(
        tmp_path, "allgather_budget", collective_timeout_s=AGREEMENT_TIMEOUT_S, timeout_s=6 * AGREEMENT_TIMEOUT_S,
        disk_dir=str(tmp_path / "spill"), gguf_expert=gguf_expert,
    )  # fmt: skip
    raise_rank_errors(results)
    return results


def test_wan_beyond_each_ranks_budget_streams_its_shards_from_disk_bit_identically(ranks):
    for rank, r in enumerate(ranks):
        assert r["wan_equal"] == [True, True], rank
        budget, num_host, num_disk, pooled = r["wan_tier"]
        assert budget == r["budget"] and pooled and num_disk > 0, r["wan_tier"]
        # every block is a disk-tier block holding this rank's shard, gathered from the staging ring or the pool
        parts = r["wan_parts"]
        assert len(parts) == 6 and {part for _, part, _ in parts.values()} == {"ShardPart"}, parts
        assert {kind for kind, _, _ in parts.values()} == {"DiskBlock", "PooledBlock"}, parts
        assert all(nbytes == r["shard_nbytes"] < r["wan_block_nbytes"][p] for p, (_, _, nbytes) in parts.items())
        assert r["wan_spill_files"] == 0  # the DiTs are views of the checkpoint: each shard reads its file ranges
        stats = r["wan_stats"]
        assert 0 < stats["host_bytes"] <= r["budget"]  # the runtime's own accounting: the pool's shards
        assert stats["host_pool_bytes"] == stats["host_bytes"] and stats["disk_bytes_read"] > 0
        assert stats["disk_staging_bytes"] == 3 * r["shard_nbytes"]  # the ring holds shards, not whole blocks
        # VmRSS grows by what the store accounts for (on the CPU the slot ring is host memory too), and no more
        accounted = stats["host_bytes"] + stats["disk_staging_bytes"] + stats["slot_bytes"]
        assert r["wan_rss_growth"] <= accounted + RSS_SLACK_BYTES, (r["wan_rss_growth"], accounted)
        assert r["wan_restored"] and r["wan_files_left"] == []


def test_auto_with_allgather_gives_each_rank_its_share_of_the_hosts_free_memory(ranks):
    for r in ranks:
        assert r["auto_equal"] == [True, True] and r["auto_restored"]
        choice = r["auto_choice"]
        assert "shared by the 2 allgather ranks on this host: 1/2 each" in choice["reason"], choice["reason"]
        assert choice["streamed_bytes"] == 6 * r["shard_nbytes"]  # priced in this rank's shards
        # faked: each rank's half of the host's free memory, less what runs beside the store, is its budget
        faked = r["faked_choice"]
        assert faked["free_bytes"] == r["faked_free"] // 2
        assert faked["budget_bytes"] == faked["free_bytes"] - sum(faked["needs"].values())
        assert {k: v for k, v in faked["needs"].items() if not k.startswith("reserve")} == r["faked_needs"]
        assert 2 * r["shard_nbytes"] <= faked["budget_bytes"] < 3 * r["shard_nbytes"]
        assert r["faked_tier"][0] == faked["budget_bytes"] and r["faked_tier"][2] > 0
        assert r["faked_equal"] == [True, True] and r["faked_restored"]
        assert r["faked_spill_files"] == 6  # the DiTs were given back in memory by a disable: their shards spilled
        assert r["faked_stats"]["host_bytes"] <= faked["budget_bytes"]


def test_ranks_with_budgets_of_their_own_place_other_blocks_on_disk_and_still_agree(ranks):
    assert ranks[0]["toy_host_blocks"] != ranks[1]["toy_host_blocks"]
    for rank, r in enumerate(ranks):
        assert r["toy_equal"] == [True, True, True], rank
        assert 0 < r["toy_host_bytes"] <= r["toy_budget"]
        kinds = {kind for kind, _, _ in r["toy_parts"].values()}
        assert kinds == {"ShardedBlock", "DiskBlock"}, r["toy_parts"]
        # with blocks on disk every gather goes through the engine's issuing thread, host shards' too: one order
        assert r["toy_issue_thread"] == {True}
        assert len(r["toy_host_blocks"]) == 2 + 3 * rank
        assert r["toy_spill_files"] == 7 - len(r["toy_host_blocks"])  # the toy lives in memory: its shards spilled
        # disable gathers every block back in one order, host and disk shards alike, and removes the files
        assert r["toy_restored"] and r["toy_files_left"] == []


def test_lossless_shards_beyond_each_ranks_budget_spill_coded_and_stream_bit_identically(ranks):
    from layerstream.distributed.collectives import shard_nbytes

    for rank, r in enumerate(ranks):
        lossless = r["lossless"]
        assert lossless["equal"] == [True, True], rank  # as the same bfloat16 weights streamed uncompressed
        stats, parts = lossless["stats"], lossless["parts"]
        assert 0 < stats["host_bytes"] <= lossless["budget"]  # the budget counts coded bytes
        assert 0 < stats["stored"] < 0.9 * stats["decoded"] and stats["disk_bytes_read"] > 0
        assert {kind for kind, _, _ in parts.values()} == {"ShardedBlock", "DiskBlock"}, parts
        # each rank keeps (and reads from disk) 1/N of each block's coded bytes, in host memory or in a spill file
        assert all(kept == shard_nbytes(lossless["coded_nbytes"][p], 2) for p, (_, _, kept) in parts.items()), parts
        on_disk = [p for p, (kind, _, _) in parts.items() if kind == "DiskBlock"]
        assert lossless["spill_files"] == len(on_disk) > 0
        assert lossless["restored"] and lossless["files_left"] == []  # disable gives back the originals bit for bit


def test_a_gguf_expert_sharded_by_allgather_streams_bit_identically_to_one_process(ranks):
    """Both ranks load the low-noise expert from one GGUF file; each keeps a shard of its quantized bytes."""
    if ranks[0]["gguf"] is None:
        pytest.skip("the gguf package is not installed")
    for rank, r in enumerate(ranks):
        gguf = r["gguf"]
        assert "error" not in gguf, gguf.get("error")
        assert gguf["equal"] == [True, True] and gguf["restored"], rank
        assert gguf["differs_from_folder"] and gguf["weight"] == "GGUFParameter"
        shards = {path: s for path, s in gguf["shards"].items() if path.startswith("transformer_2.")}
        assert shards and all(kind == "ShardedBlock" and 0 < held < whole for kind, held, whole in shards.values()), shards
