"""On an accelerator the compute thread queues kernels; what streaming makes it wait for on the host is kept off
it where it can be. A disk-tier block's copy job waits for its read, so the accelerator engine queues it on its
issuing thread: the compute thread never reads the disk nor waits on a staging buffer's event, and only waits
(on the host) at the block that needs the bytes, when they are not there yet. Checked on the CPU with the
recording stand-in for torch.cuda and a simulated slow disk; the runtime's own stats say where the time went."""

from __future__ import annotations

import threading

import pytest
import torch

from layerstream import enable_offload
from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.stores.disk.disk_store import DiskBlock
from layerstream.runtime.stores.disk.staging import StagingRing
from runtime_toys import ToyDiT, run
from test_accelerator_protocol import Recorder

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DISK_GBPS = 0.002  # 2 MB/s: each ~9 KB block takes ~4 ms to read, far longer than its compute


def _threads_of(monkeypatch) -> dict[str, set[str]]:
    """Where disk reads and copies out of the staging ring run during the test (thread names)."""
    seen: dict[str, set[str]] = {"read": set(), "staging copy": set()}
    real_read, real_copy = DiskBlock.read_into_, StagingRing.copy_

    def read_into_(self, buffer):
        seen["read"].add(threading.current_thread().name)
        return real_read(self, buffer)

    def copy_(self, *args, **kwargs):
        seen["staging copy"].add(threading.current_thread().name)
        return real_copy(self, *args, **kwargs)

    monkeypatch.setattr(DiskBlock, "read_into_", read_into_)
    monkeypatch.setattr(StagingRing, "copy_", copy_)
    return seen


@pytest.mark.parametrize("issue_thread", [True, False], ids=["issuing-thread", "compute-thread"])
def test_disk_tier_reads_and_their_waits_stay_off_the_compute_thread(issue_thread, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ToyDiT(dim=32, num_blocks=6).eval()
    x = torch.randn(2, 32)
    expected = run(model, (x,))
    block = BlockLayout("b", model.blocks[0]).nbytes
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 2.5 * block / 1e9, "disk_dir": str(tmp_path)}
    recorder = Recorder()
    handle = enable_offload(
        model, config, device="cpu", simulated_disk_gbps=DISK_GBPS,
        engine_factory=lambda device, n: AcceleratorCopyEngine(device, n, api=recorder, issue_thread=issue_thread),
    )
    assert len(handle.placement.host_tier.disk_block_paths) == 4
    assert torch.equal(run(model, (x,)), expected)  # the first forward learns the order
    seen = _threads_of(monkeypatch)
    before = handle.stats()
    for _ in range(2):
        assert torch.equal(run(model, (x,)), expected)
    after = handle.stats()
    compute = threading.current_thread().name
    stall = after.stall_seconds - before.stall_seconds
    issue = after.copy_issue_seconds - before.copy_issue_seconds
    disk_stall = after.disk_stall_seconds - before.disk_stall_seconds
    if issue_thread:
        # the compute thread read nothing and copied nothing out of the ring: the issuing thread did
        # (it waited on the host only in wait_ready, at a block whose bytes were late: how often is the disk's say)
        assert seen["staging copy"] == {"layerstream-copy-issue"} and compute not in seen["read"]
    else:
        # before the issuing thread: the compute thread ran every disk job itself, waits for reads included
        assert seen["staging copy"] == {compute} and stall == 0
    # whichever thread ran the jobs, compute's wait on the disk is counted only as a part of its blocked time
    assert 0 <= disk_stall <= stall + issue
    handle.disable()
    assert not [t.name for t in threading.enumerate() if t.name == "layerstream-copy-issue"]
    assert torch.equal(run(model, (x,)), expected)
