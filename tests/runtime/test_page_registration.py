"""Every host buffer a store may page-lock starts on a page and shares no page with another buffer: CUDA
registers whole pages and refuses a page registered twice, which left such a block pageable (a host-synchronous
copy per block). The stand-in engine here registers pages the way CUDA does, overlap refused."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from layerstream.runtime.engines.copy_engine import CpuCopyEngine
from layerstream.runtime.packing.host_buffer import PAGE_BYTES
from layerstream.runtime.packing.layout import BlockLayout
from tests.runtime.runtime_toys import ToyDiT, make_my_pipeline

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def page_span(buffer: torch.Tensor) -> tuple[int, int]:
    """[first, last] page numbers a buffer touches (what registering it page-locks)."""
    start = buffer.data_ptr()
    end = start + max(buffer.numel() * buffer.element_size(), 1) - 1
    return start // PAGE_BYTES, end // PAGE_BYTES

class PageRegisteringEngine(CpuCopyEngine):
    """The CPU engine, pinning as CUDA does: whole pages, a page already registered fails the registration."""

    registered: dict[int, tuple[int, int]]
    refused: list[int]

    def __init__(self, device, num_slots):
        super().__init__(device, num_slots)
        self.registered, self.refused = {}, []

    def pin_(self, buffer: torch.Tensor) -> bool:
        first, last = page_span(buffer)
        if any(first <= b and a <= last for a, b in self.registered.values()):
            self.refused.append(buffer.data_ptr())
            return False
        self.registered[buffer.data_ptr()] = (first, last)
        return True

    def unpin_(self, buffer: torch.Tensor) -> None:
        del self.registered[buffer.data_ptr()]


@pytest.mark.parametrize("case", ["packed", "float8", "disk-tier"])
def test_every_block_buffer_of_a_dim_256_toy_can_be_page_locked(case, tmp_path):
    pipe = make_my_pipeline(dim=256)
    pipe.transformer = ToyDiT(dim=256, num_blocks=6)
    engines = []

    def engine_factory(device, num_slots):
        engines.append(PageRegisteringEngine(device, num_slots))
        return engines[-1]

    config: dict = {"mode": "layer", "components": ["dit"]}
    if case == "float8":
        config["layer_options"] = {"dit": {"storage_dtype": "float8_e4m3fn"}}
    if case == "disk-tier":
        block = BlockLayout("b", pipe.transformer.blocks[0]).nbytes
        config.update(host_budget_gb=3.5 * block / 1e9, disk_dir=str(tmp_path))
    handle = enable_offload(pipe, config, device="cpu", engine_factory=engine_factory)
    (engine,) = engines
    stats = handle.stats()
    assert engine.refused == []
    assert stats.pinned_host_bytes == stats.host_bytes > 0  # every block buffer (and the pool) page-locked
    assert all(ptr % PAGE_BYTES == 0 for ptr in engine.registered)
    if case == "disk-tier":
        assert stats.disk_staging_bytes > 0 and len(engine.registered) > len(handle.placement.host_tier.host_block_paths)
    handle.disable()
    assert engine.registered == {}  # everything unregistered at disable
