"""float8 storage (`storage_dtype`) with `weight_transfer: "allgather"`: each rank keeps 1/N of every block's
float8 bytes, the ranks gather them into the slot's staging region and cast them into the compute layout on
the device. Outputs are bit-identical to float8 in one process (rank-local), on 2 gloo ranks on loopback. The
same launch runs the lossless form (`"lossless"`) with allgather: 1/N of the coded bytes per rank, decoded in
the slot, outputs bit-identical to the same bfloat16 weights streamed uncompressed."""

from __future__ import annotations

import pytest

from dist_harness import AGREEMENT_TIMEOUT_S, raise_rank_errors, run_ranks
from layerstream.distributed.collectives import shard_nbytes
from layerstream.runtime.packing.layout import ALIGN_BYTES

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("ranks")


def test_two_ranks_hold_half_the_float8_bytes_each_and_match_float8_in_one_process(tmp_path):
    results = run_ranks(tmp_path, "float8_allgather", collective_timeout_s=AGREEMENT_TIMEOUT_S, timeout_s=4 * AGREEMENT_TIMEOUT_S)
    raise_rank_errors(results)
    for rank, r in enumerate(results):
        for key in ("both", "dit"):
            assert r[f"{key}_equal"] == [True, True, True], (rank, key)
            shards = r[f"{key}_shards"]
            assert len(shards) == 4 + 3 and {kind for _, _, kind in shards.values()} == {"ShardedBlock"}
            # each rank keeps ceil(stored / 2), aligned: the float8 blocks' stored bytes, halved
            assert all(mine == shard_nbytes(whole, 2) for mine, whole, _ in shards.values()), shards
            sharded, local = r[f"{key}_host_bytes"]
            assert local / 2 <= sharded <= local / 2 + ALIGN_BYTES * len(shards)
            # over its own host link a rank moves only its shard of each block
            assert all(r[f"{key}_link_bytes"][p] == mine for p, (mine, _, _) in shards.items())
            assert r[f"{key}_restored"] and r[f"{key}_equal_after_disable"]
        # the encoder kept as it is holds more bytes than in float8: the two configs differ where they should
        encoder = [p for p in results[rank]["dit_shards"] if p.startswith("prompt_model.")]
        assert all(r["dit_shards"][p][1] > r["both_shards"][p][1] for p in encoder)
        # storage_dtype "lossless" (same launch): each rank keeps 1/N of the coded bytes, outputs as uncompressed
        lossless = r["lossless"]
        assert lossless["equal"] == [True, True], rank
        stored, decoded = lossless["stored_decoded"]
        assert 0 < stored < 0.9 * decoded
        shards = lossless["shards"]
        assert {kind for _, _, kind in shards.values()} == {"ShardedBlock"}
        assert all(mine == shard_nbytes(whole, 2) for mine, whole, _ in shards.values()), shards
        assert lossless["restored"]

