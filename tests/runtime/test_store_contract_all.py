"""The complete `HostStore` contract, run against every store the composition builds: packed, float8, sharded
(a gloo group of one), disk (spill files), pooled (a host pool of one member) and tiered (half the blocks on
disk). The same calls for all: the two sizes (`slot_nbytes`, `host_nbytes`), `place_`, `check_layouts_`,
`stage_`, `commit_`, copy jobs into a slot, `follow_order_`, `stats()` and `restore_`."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from layerstream.errors import UnsupportedUseError
from layerstream.plan.placement import HostPoolChoice, HostTierChoice, Placement, PrefetchChain
from layerstream.runtime.contracts import HostStore, StoredBlock, StoreStats
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.float8 import float8_forms
from layerstream.runtime.forms.lossless import lossless_forms
from layerstream.runtime.stores.disk.disk_store import DiskHostStore
from layerstream.runtime.stores.local_store import LocalHostStore
from layerstream.runtime.stores.tiered_store import TieredHostStore
from tests.runtime.runtime_toys import ToyDiT

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
KINDS = ["packed", "float8", "lossless", "sharded", "disk", "pooled", "tiered"]
LOSSY = {"float8"}



def _placement(paths: list[str], layouts: list[BlockLayout], kind: str) -> Placement:
    chain = PrefetchChain("dit", tuple(paths), 1)
    tier = None
    if kind in ("disk", "pooled", "tiered"):
        on_disk = tuple(paths if kind != "tiered" else paths[1::2])
        pool = None
        if kind == "pooled":
            pool = HostPoolChoice(("dit",), tuple((p,) for p in paths[:2]), tuple(l.nbytes for l in layouts[:2]), MappingProxyType({"dit": tuple(paths)}))
            on_disk = tuple(paths[2:])
        tier = HostTierChoice(0, tuple(p for p in paths if p not in on_disk and (pool is None or p not in pool.block_paths)), on_disk, 0, "test", pool)
    slot = max(l.nbytes for l in layouts)
    return Placement(MappingProxyType({}), (chain,), 2, slot, MappingProxyType({p: l.nbytes for p, l in zip(paths, layouts)}), tier)


def _store(kind: str, model, tmp_path, request) -> HostStore:
    if kind == "packed":
        return LocalHostStore()
    if kind == "float8":
        return LocalHostStore(float8_forms(model, torch.float8_e4m3fn).form)
    if kind == "lossless":
        return LocalHostStore(lossless_forms().form)
    if kind == "sharded":
        request.getfixturevalue("gloo_group_of_one")
        from layerstream.distributed.collectives import BlockGather
        from layerstream.distributed.process_group import GroupMembership
        from layerstream.distributed.sharded_store import ShardedHostStore

        return ShardedHostStore(BlockGather("ToyPipeline", GroupMembership(None, 0, 1, "gloo", CPU)))
    if kind == "tiered":
        return TieredHostStore(LocalHostStore(), DiskHostStore(tmp_path))
    return DiskHostStore(tmp_path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("kind", KINDS)
def test_every_store_through_the_same_calls(kind, tmp_path, request):
    torch.manual_seed(0)
    model = ToyDiT(dim=16, num_blocks=4)
    if kind == "lossless":  # bfloat16 weights of 4 KiB and more: what the lossless form codes
        model = ToyDiT(dim=64, num_blocks=4).to(torch.bfloat16)
    paths = [f"blocks.{i}" for i in range(4)]
    layouts = [BlockLayout(p, b, CPU) for p, b in zip(paths, model.blocks)]
    originals = [[_bits(t) for t in list(b.parameters()) + list(b.buffers())] for b in model.blocks]
    store = _store(kind, model, tmp_path, request)
    assert isinstance(store, HostStore) and store.kind

    # the two sizes: what a slot needs, and what the host keeps when the store holds the block in host memory
    for layout in layouts:
        slot, host = store.slot_nbytes(layout), store.host_nbytes(layout)
        assert slot >= layout.nbytes and 0 <= host <= slot
        expected_host = {"float8": None, "disk": 0, "pooled": 0}.get(kind, layout.nbytes)
        if kind == "float8":
            assert host < layout.nbytes / 2  # float32 weights stored in one byte each, norms and buffers as they are
        elif kind == "lossless":
            assert host < 0.9 * layout.nbytes and slot == layout.nbytes + host  # the decoded block, then the coded one
        else:
            assert host == expected_host
    placement = _placement(paths, layouts, kind)
    store.place_(placement)
    slot_nbytes = placement.slot_nbytes if kind not in ("float8", "lossless") else max(store.slot_nbytes(l) for l in layouts)
    store.check_layouts_(layouts, slot_nbytes)
    stored = [store.stage_(layout, CPU, None) for layout in layouts]
    store.commit_()
    store.follow_order_(lambda path: paths[(paths.index(path) + 1) % len(paths)] if path in paths else None, len(paths))
    assert all(isinstance(b, StoredBlock) for b in stored)
    assert all(t.numel() == 0 for b in model.blocks for t in b.parameters())  # placeholders while enabled

    slot = torch.zeros(slot_nbytes, dtype=torch.uint8)
    seen = []
    for block, layout in zip(stored, layouts):
        # what a block holds is what the store priced it at (a disk block: at most its few spans made in memory)
        assert block.host_bytes <= max(store.host_nbytes(layout), layout.nbytes // 8)
        assert block.copy_job(slot)() == block.link_bytes
        seen.append([_bits(v) for v in block.layout.views(slot)])
        block.count_stall_(0.0)  # declared for every block
        if kind == "float8":
            with pytest.raises(UnsupportedUseError):
                block.check_lora_()  # PEFT would make its adapters in float8
        else:
            block.check_lora_()
    stats = store.stats()
    assert isinstance(stats, StoreStats)
    if kind in ("disk", "pooled", "tiered"):
        assert stats.disk_bytes_read > 0
    if kind == "pooled":
        assert stats.host_pool_bytes == sum(l.nbytes for l in layouts[:2]) == stats.host_bytes
    else:
        assert stats.host_pool_bytes == 0
    if kind in ("disk", "tiered"):
        assert stats.disk_staging_bytes >= slot_nbytes

    store.restore_(CPU)
    for block_module, views, original in zip(model.blocks, seen, originals):
        restored = [_bits(t) for t in list(block_module.parameters()) + list(block_module.buffers())]
        # a slot shows exactly what disable gives back; lossless stores give back the originals
        assert all(torch.equal(a, b) for a, b in zip(views_in_model_order(views, block_module, stored, model), restored))
        if kind not in LOSSY:
            assert all(torch.equal(a, b) for a, b in zip(restored, original))


def views_in_model_order(views, block_module, stored, model):
    """The slot views of a block (in layout-entry order) in the block's parameters-then-buffers order."""
    index = list(model.blocks).index(block_module)
    layout = stored[index].layout
    by_tensor = {}
    for entry, view in zip(layout.entries, views):
        by_tensor.setdefault((id(entry.module), entry.name), view)
    order = [(id(m), n) for m in block_module.modules() for n, p in m._parameters.items() if p is not None]
    order += [(id(m), n) for m in block_module.modules() for n, b in m._buffers.items() if b is not None]
    return [by_tensor[key] for key in order]
