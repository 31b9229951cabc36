"""`benchmarks/distributed.py --nproc 2` end to end: two ranks under torchrun, rank-local layerwise against allgather.

No timing is asserted. What is checked is the shape of the JSON and what does not depend on speed: each
rank keeps half of every block's bytes on the host and moves half over its link (plus at most the shards'
alignment padding), and every output equals resident's bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layerstream.runtime.packing.layout import ALIGN_BYTES

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("serving_ranks")  # torchrun groups: beside tests/distributed's "ranks", not with them

STREAMED = ("layerwise", "layerwise-allgather")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "distributed.py"


@pytest.fixture(scope="module")
def two_rank_json() -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--nproc", "2", "--smoke", "--json", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=180,  # two ranks of the tiny model take seconds; a rank stuck in a collective must not hang CI
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # rank 0 prints the JSON and nothing else; the other rank prints nothing


def test_every_rank_reports_both_strategies(two_rank_json):
    assert two_rank_json["schema"] == "layerstream.bench.distributed/1"
    assert two_rank_json["world_size"] == 2 and two_rank_json["backend"] == "gloo"
    rows = {(row["rank"], row["strategy"]): row for row in two_rank_json["rows"]}
    for rank in (0, 1):
        for strategy in ("resident", *STREAMED):
            row = rows[(rank, strategy)]
            assert row["median_seconds"] > 0 and row["min_seconds"] > 0
            assert row["matches_resident"] is True, (rank, strategy)
        assert rows[(rank, "layerwise")]["weight_transfer"] == "rank-local"
        assert rows[(rank, "layerwise-allgather")]["weight_transfer"] == "allgather"
    assert [r["rank"] for r in two_rank_json["ratios"]] == [0, 1]


def test_allgather_halves_host_and_link_bytes_per_rank(two_rank_json):
    block_bytes = two_rank_json["run"]["block_bytes"]
    padding = ALIGN_BYTES * len(block_bytes)  # each block's shard is rounded up to the alignment
    rows = {(row["rank"], row["strategy"]): row for row in two_rank_json["rows"]}
    for rank in (0, 1):
        local, gathered = rows[(rank, "layerwise")], rows[(rank, "layerwise-allgather")]
        assert local["host_bytes"] == sum(block_bytes)
        assert local["link_bytes_per_forward"] == sum(block_bytes)  # every block once per forward
        for field in ("host_bytes", "link_bytes_per_forward"):
            half = local[field] / 2
            assert half <= gathered[field] < half + padding, (rank, field)
        assert gathered["transfers_per_forward"] == local["transfers_per_forward"] == len(block_bytes)
    for ratio in two_rank_json["ratios"]:
        assert ratio["host_bytes"] == pytest.approx(0.5, abs=0.01)
        assert ratio["link_bytes_per_forward"] == pytest.approx(0.5, abs=0.01)
        assert ratio["median_seconds"] > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--nproc", "0"], "--nproc = 0 is not valid"),
        (["--nproc", "2", "--strategies", "resident,naive"], "unrecognized arguments: --strategies"),  # every rank runs its own rows
        (["--nproc", "2", "--host-budget-gb", "1"], "unrecognized arguments: --host-budget-gb"),
        (["--nproc", "2", "--repeats", "0"], "--repeats"),  # `layerstream bench`'s own checks, before any rank starts
    ],
)
def test_nproc_rejects_what_it_does_not_run(extra, message):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", *extra], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, extra
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distributed.py: error: ") and message in last, last
