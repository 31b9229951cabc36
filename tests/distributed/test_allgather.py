"""`weight_transfer: "allgather"` on CPU with gloo: 2 ranks on loopback, each with a hard timeout."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from dist_harness import AGREEMENT_TIMEOUT_S, raise_rank_errors, run_ranks
from dist_toys import UnreplicatedPipeline, config, make_inputs, make_pipeline, run, same_state, snapshot
from layerstream import OffloadPlanResolutionError, enable_offload
from layerstream.distributed.collectives import shard_nbytes
from layerstream.errors import OffloadError
from layerstream.runtime.packing.layout import ALIGN_BYTES

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("ranks")

_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast", "barrier")


@pytest.fixture
def no_collectives(monkeypatch):
    """Fail the test if any collective is issued."""
    calls = []

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.distributed.{name} was called")

        return call

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden(name))
    return calls


def test_two_ranks_bit_identical_half_host_bytes_and_disable_restores(tmp_path):
    results = run_ranks(tmp_path, "roundtrip", collective_timeout_s=AGREEMENT_TIMEOUT_S, timeout_s=4 * AGREEMENT_TIMEOUT_S)
    raise_rank_errors(results)
    for rank, r in enumerate(results):
        assert r["local_equal"] and r["evicted"]
        assert r["equal"] == [True, True, True], f"rank {rank}"
        assert r["num_streamed_blocks"] == 4 + 3
        # each rank holds ceil(block / 2) aligned: half of rank-local, within the alignment padding
        assert r["shard_nbytes"] == [shard_nbytes(n, 2) for n in r["block_nbytes"]]
        assert r["local_host_bytes"] == sum(r["block_nbytes"])
        assert r["local_host_bytes"] / 2 <= r["host_bytes"] <= r["local_host_bytes"] / 2 + ALIGN_BYTES * len(r["block_nbytes"])
        # over its own host link a rank moves only its shards; the slots hold the whole gathered block
        assert r["bytes_transferred"] <= r["num_transfers"] * max(r["shard_nbytes"])
        assert r["slot_bytes"] == r["num_slots"] * 2 * max(r["shard_nbytes"])
        assert r["restored_state"] and r["restored_params"] and r["equal_after_disable"]
        assert r["second_equal"] == [True, True] and r["second_resident_block_kept"]
        assert r["second_stats"] == (3, 1, 3)
        assert r["second_restored"]
        # the DiT sharded, the encoder rank-local, in one pipeline: the encoder keeps its 3 blocks whole
        dit_sharded, encoder_whole = r["mixed_host_bytes"]
        assert r["mixed_equal"] and r["mixed_restored"]
        assert dit_sharded == sum(r["shard_nbytes"][3:]) and encoder_whole == sum(r["block_nbytes"][:3])
    assert results[0]["summaries"] == [{"rank": 0, "host_bytes": results[0]["host_bytes"]}, {"rank": 1, "host_bytes": results[1]["host_bytes"]}]
    assert results[1]["summaries"] is None


def test_ranks_that_cannot_agree_all_raise_promptly_and_stay_untouched(tmp_path):
    # no peer stalls here: a collective timeout that holds under load, and a hard limit well above it for a hang
    results = run_ranks(tmp_path, "mismatch", collective_timeout_s=AGREEMENT_TIMEOUT_S, timeout_s=4 * AGREEMENT_TIMEOUT_S)
    raise_rank_errors(results)
    for rank, r in enumerate(results):
        assert "different block layouts" in r["shapes"] and "rank 0:" in r["shapes"] and "rank 1:" in r["shapes"], r["shapes"]
        assert r["shapes_untouched"]
        assert r["local_check_untouched"]
        assert r["apply_untouched"], f"rank {rank} not rolled back"
        assert r["afterwards_equal"]
        # a rank's own failure reaches the others through the vote (whose words these are), not a collective timeout
        assert "timed out" not in (r["shapes"] + r["local_check"]).lower()
    assert "shares memory" in results[1]["local_check"]
    assert "rank(s) 1 could not enable offload" in results[0]["local_check"]
    assert results[1]["apply"] == "MemoryError: simulated allocation failure"  # a resource error, as itself
    assert "rank(s) 1 failed while enabling offload" in results[0]["apply"]


@pytest.mark.parametrize("then", ["idle", "exit"])
def test_rank_failing_inside_a_block_ends_the_others_with_an_error_not_a_hang(tmp_path, then):
    results = run_ranks(tmp_path, "rank_fails", then=then, exit_codes={1: 17} if then == "exit" else None)
    survivor = results[0]
    assert "traceback" not in survivor, survivor.get("traceback")
    assert survivor["error"] is not None
    assert "allgather" in survivor["error"] and "rank 0 of 2" in survivor["error"]
    # an error, not a hang: run_ranks fails the test if a rank is still running at its hard limit
    assert survivor["disable"].startswith("TransferError") and "restart every rank" in survivor["disable"]
    if then == "exit":
        assert results[1]["exitcode"] == 17
    else:
        assert results[1]["raised"] == "boom in block 2"


def test_ranks_running_different_blocks_all_raise_and_can_still_disable(tmp_path):
    results = run_ranks(tmp_path, "diverge")
    raise_rank_errors(results)
    for r in results:
        assert r["error"] is not None, "the divergence must be reported"
        assert "ranks disagree" in r["error"]
        # rank 1 learned 0 -> 2 in the first forward; in the second both prefetch after block 0 and part ways
        found = re.search(r"rank 0 is at #(\d+): transfer of transformer\.blocks\.1; rank 1 is at #(\d+): transfer of transformer\.blocks\.2", r["error"])
        assert found and found[1] == found[2], r["error"]
        assert r["forwards"] == 1  # caught at the first transfer that parts ways, not by a collective timeout
        assert "allgather" in r["again"]  # raised again at once, no collective waits
        assert r["restored"]


def test_group_of_one_runs_no_collective(monkeypatch, no_collectives):
    from layerstream.distributed.launch import free_port
    from layerstream.distributed.process_group import destroy_distributed, init_distributed

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    init_distributed("cpu")
    try:
        pipe = make_pipeline()
        inputs = make_inputs(seed=1)
        expected, state = run(pipe, inputs), snapshot(pipe)
        handle = enable_offload(pipe, config(), device="cpu")
        assert [torch.equal(run(pipe, inputs), expected) for _ in range(2)] == [True, True]
        assert handle.stats().host_bytes == sum(b.host.layout.nbytes for b in handle.streamer.blocks)
        handle.disable()
        assert same_state(state, snapshot(pipe))
    finally:
        destroy_distributed()
    assert no_collectives == []


def test_allgather_without_torch_distributed_is_one_rank(no_collectives):
    pipe = make_pipeline()
    inputs = make_inputs(seed=1)
    expected = run(pipe, inputs)
    handle = enable_offload(pipe, config(), device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    handle.disable()


def test_allgather_under_torchrun_without_a_group_is_an_error(monkeypatch, no_collectives):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe = make_pipeline()
    state = snapshot(pipe)
    with pytest.raises(OffloadError, match="WORLD_SIZE=2 but torch.distributed is not initialized"):
        enable_offload(pipe, config(), device="cpu")
    assert same_state(state, snapshot(pipe))


def test_encoder_not_declared_replicated_is_refused_before_any_collective(no_collectives):
    pipe = make_pipeline(cls=UnreplicatedPipeline)
    with pytest.raises(OffloadPlanResolutionError, match="encoder_dlo_weight_replication"):
        enable_offload(pipe, config(), device="cpu")
    enable_offload(pipe, config(("dit",)), device="cpu").disable()  # the DiT alone may use allgather


def test_shards_cover_the_block_at_aligned_offsets():
    for nbytes in (64, 65, 1000, 4096, 12345):
        for world_size in (1, 2, 3, 8):
            size = shard_nbytes(nbytes, world_size)
            assert size % ALIGN_BYTES == 0 and world_size * size >= nbytes
            assert size - ALIGN_BYTES < -(-nbytes // world_size) <= size


def test_single_process_use_never_imports_layerstream_distributed():
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, %r)
        from dist_toys import config, make_inputs, make_pipeline, run
        from layerstream import enable_offload
        pipe = make_pipeline()
        handle = enable_offload(pipe, config(transfer="rank-local"), device="cpu")
        run(pipe, make_inputs(seed=1))
        handle.disable()
        loaded = [m for m in sys.modules if m.startswith("layerstream.distributed")]
        assert not loaded, loaded
        """
        % str(__import__("pathlib").Path(__file__).parent)
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_transfer_protocol_on_one_rank_with_the_group_of_one_shortcut_off(monkeypatch, device):
    """The whole protocol (votes, headers on the CPU, payload gathers into the slots, restore) in one process:
    on CUDA this is the NCCL payload path, on the copy stream."""
    import layerstream.distributed.process_group as process_group
    from layerstream.distributed.launch import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    device = process_group.init_distributed(device)
    try:
        backend = str(dist.get_backend())
        monkeypatch.setattr(
            process_group, "join_offload_group", lambda cls, dev, group=None: process_group.GroupMembership(group, 0, 1, backend, dev)
        )
        calls = []
        for name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
            real = getattr(dist, name, None)
            if real is not None:
                def spy(*args, _real=real, _name=name, **kwargs):
                    output = args[0][0] if isinstance(args[0], list) else args[0]
                    calls.append((_name, output.device.type, output.dtype))
                    return _real(*args, **kwargs)

                monkeypatch.setattr(dist, name, spy)
        pipe = make_pipeline().to(device)
        inputs = tuple(t.to(device) for t in make_inputs(seed=2))
        expected, state = run(pipe, inputs), snapshot(pipe)
        handle = enable_offload(pipe, config(), device=device)
        assert [torch.equal(run(pipe, inputs), expected) for _ in range(3)] == [True, True, True]
        handle.disable()
        assert same_state(state, snapshot(pipe)) and torch.equal(run(pipe, inputs), expected)
    finally:
        process_group.destroy_distributed()
    headers = [c for c in calls if c[2] == torch.int64]
    payloads = [c for c in calls if c[2] == torch.uint8]
    assert headers and all(c[1] == "cpu" for c in headers)  # votes and headers never wait for the device
    assert len(payloads) == len(headers) - 2  # one payload per header; the 2 votes carry none
    assert all(c[1] == device.type for c in payloads)
    if device.type == "cuda":
        assert all(c[0] != "all_gather" for c in payloads)  # NCCL: one in-place gather into the slot
