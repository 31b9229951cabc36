"""`weight_transfer: "allgather"` on CUDA: the copy stream and its events around the gathers (skipped without CUDA).

Two ranks need two GPUs for NCCL (NCCL refuses two ranks on one GPU); on a single GPU the two ranks share it
over gloo, which gathers CUDA tensors too and exercises the same stream ordering.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import raise_rank_errors, run_ranks
from dist_toys import config, make_inputs, make_pipeline, run, same_state, snapshot
from layerstream import enable_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check_roundtrip(results):
    raise_rank_errors(results)
    for r in results:
        assert r["engine"] == "accelerator-streams"
        assert r["evicted"] and r["equal"] == [True, True, True] and r["local_equal"]
        assert r["host_bytes"] <= r["local_host_bytes"] / 2 + 64 * len(r["block_nbytes"])
        assert r["restored_state"] and r["restored_params"] and r["equal_after_disable"]
        assert r["second_equal"] == [True, True] and r["second_resident_block_kept"] and r["second_restored"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_ranks_nccl_bit_identical(tmp_path):
    _check_roundtrip(run_ranks(tmp_path, "roundtrip", device="cuda", timeout_s=120))


def test_two_ranks_sharing_one_gpu_over_gloo_bit_identical(tmp_path):
    _check_roundtrip(run_ranks(tmp_path, "roundtrip", device="cuda:0", backend="gloo", timeout_s=120))


def test_group_of_one_on_cuda_runs_no_collective(monkeypatch):
    from layerstream.distributed.launch import free_port
    from layerstream.distributed.process_group import destroy_distributed, init_distributed

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    device = init_distributed("cuda")
    try:
        assert device == torch.device("cuda", 0) and "nccl" in str(dist.get_backend())
        for name in ("all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast"):
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} called"))
        pipe = make_pipeline().to(device)
        inputs = tuple(t.to(device) for t in make_inputs(seed=1))
        expected, state = run(pipe, inputs), snapshot(pipe)
        handle = enable_offload(pipe, config(), device=device)
        assert [torch.equal(run(pipe, inputs), expected) for _ in range(2)] == [True, True]
        handle.disable()
        assert same_state(state, snapshot(pipe))
    finally:
        destroy_distributed()
