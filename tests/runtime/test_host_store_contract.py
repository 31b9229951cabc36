"""The `HostStore` contract, run against every implementation: the local packed store, and the sharded
allgather store over a real gloo group of one process (its BlockGather built directly: `open_block_gather`
gives a group of one the local store, so the sharded store's own code would not run otherwise)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout
from layerstream.runtime.stores.local_store import LocalHostStore
from layerstream.runtime.contracts import HostStore, StoredBlock

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
STORES = ["packed", "sharded-gloo-1"]


class OddBlock(nn.Module):
    """Mixed dtypes, views at odd offsets of one storage, a transposed parameter, buffers and a tied weight."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight  # tied inside the block
        self.t = nn.Parameter(torch.randn(dim, dim).T)  # non-contiguous
        base = torch.randn(5 * dim * dim + 7)
        self.q = nn.Parameter(base[3 : 3 + dim * dim].view(dim, dim))  # views of one storage, odd offsets
        self.k = nn.Parameter(base[101 : 101 + dim * dim].view(dim, dim))
        self.fp16 = nn.Parameter(torch.randn(2 * dim + 3).half()[3:])  # an fp16 view at 6 bytes
        self.register_buffer("idx", torch.arange(dim, dtype=torch.int64).flip(0))
        self.register_buffer("flag", torch.tensor([True, False, True]))
        self.register_buffer("tail", base[-5:])  # a buffer viewing the parameters' storage


def _tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(block.named_parameters(remove_duplicate=False)), **dict(block.named_buffers(remove_duplicate=False))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8) if t.dtype != torch.bool else t.detach().clone()


def _facts(block: nn.Module) -> dict:
    tensors = _tensors(block)
    return {
        "objects": {k: t for k, t in block.named_parameters(remove_duplicate=False)},
        "bits": {k: _bits(t).clone() for k, t in tensors.items()},
        "meta": {k: (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % ALIGN_BYTES) for k, t in tensors.items()},
    }


def _assert_restored(block: nn.Module, before: dict) -> None:
    params = dict(block.named_parameters(remove_duplicate=False))
    assert params.keys() == before["objects"].keys()
    assert all(p is before["objects"][k] for k, p in params.items())  # the same Parameter objects
    tensors = _tensors(block)
    for k, t in tensors.items():
        assert t.device == CPU and t.numel() > 0, k
        # same dtype, shape, strides and address residue (what kernels see), and the same bits
        assert (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % ALIGN_BYTES) == before["meta"][k], k
        assert torch.equal(_bits(t), before["bits"][k]), k
    assert block.a.weight is block.b.weight
    assert tensors["q"].untyped_storage().data_ptr() == tensors["k"].untyped_storage().data_ptr()
    assert tensors["tail"].untyped_storage().data_ptr() == tensors["q"].untyped_storage().data_ptr()



@pytest.fixture(params=STORES)
def make_store(request):
    """Builds a fresh store of the parametrized kind."""
    if request.param == "packed":
        return LocalHostStore
    request.getfixturevalue("gloo_group_of_one")
    from layerstream.distributed.collectives import BlockGather
    from layerstream.distributed.process_group import GroupMembership
    from layerstream.distributed.sharded_store import ShardedHostStore

    return lambda: ShardedHostStore(BlockGather("OddPipeline", GroupMembership(None, 0, 1, "gloo", CPU)))


class RecordingPinner:
    def __init__(self):
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[tuple[int, int]] = []

    def pin_(self, buffer):
        self.pinned.append((buffer.data_ptr(), buffer.numel()))
        return True

    def unpin_(self, buffer):
        self.unpinned.append((buffer.data_ptr(), buffer.numel()))


def _stage(store, block, pin=None, path="block"):
    layout = BlockLayout(path, block, CPU)
    store.check_layouts_([layout], store.slot_nbytes(layout))
    return layout, store.stage_(layout, CPU, pin)


def test_every_store_implements_the_protocol(make_store):
    store = make_store()
    assert isinstance(store, HostStore) and store.kind
    layout, stored = _stage(store, OddBlock())
    assert isinstance(stored, StoredBlock) and stored.path == "block" and stored.layout is layout
    store.rollback_()


def test_stage_commit_restore_gives_back_the_same_parameters_bit_for_bit(make_store):
    torch.manual_seed(0)
    block = OddBlock()
    before = _facts(block)
    store = make_store()
    layout, stored = _stage(store, block)
    store.commit_()
    # committed: the store's copy is the only one, the block holds empty placeholders
    assert all(t.numel() == 0 for t in _tensors(block).values())
    assert stored.host_bytes == layout.nbytes == store.slot_nbytes(layout) and stored.link_bytes == layout.nbytes
    store.restore_(CPU)
    _assert_restored(block, before)
    assert stored.host_bytes == 0  # the host buffer went with the restore
    store.restore_(CPU)  # a second restore restores nothing twice
    _assert_restored(block, before)


def test_rollback_before_commit_gives_back_the_originals(make_store):
    torch.manual_seed(0)
    block = OddBlock()
    before = _facts(block)
    store = make_store()
    _, first = _stage(store, block)
    other = OddBlock()
    other_before = _facts(other)
    _, second = _stage(store, other, path="other")
    store.rollback_()
    _assert_restored(block, before)
    _assert_restored(other, other_before)
    assert first.host_bytes == 0 and second.host_bytes == 0  # no host memory kept for a rolled-back enable


def test_host_buffers_are_pinned_at_their_exact_size_and_unpinned_at_restore(make_store):
    block = OddBlock()
    store = make_store()
    pinner = RecordingPinner()
    layout, stored = _stage(store, block, pinner)
    assert stored.pinned and pinner.pinned == [(pinner.pinned[0][0], stored.host_bytes)]
    assert stored.host_bytes == layout.nbytes  # no power-of-two rounding
    store.commit_()
    store.restore_(CPU)
    assert pinner.unpinned == pinner.pinned and not stored.pinned


def _entry_tensor(entry) -> torch.Tensor:
    owner = entry.module._parameters if entry.is_param else entry.module._buffers
    return owner[entry.name]


def test_copy_job_fills_a_slot_with_exactly_the_packed_bytes(make_store):
    torch.manual_seed(0)
    block = OddBlock()
    probe = BlockLayout("block", block, CPU)
    originals = [_bits(_entry_tensor(e)).clone() for e in probe.entries]
    packed = torch.zeros(probe.nbytes, dtype=torch.uint8)
    probe.copy_sources_into(packed)  # the packed bytes, straight from the original storages
    covered = torch.zeros(probe.nbytes, dtype=torch.bool)
    for _, _, length, dst in probe._spans:  # bytes some tensor lives in (the rest is alignment padding)
        covered[dst : dst + length] = True

    store = make_store()
    layout, stored = _stage(store, block)
    store.commit_()
    assert layout.nbytes == probe.nbytes
    slot_nbytes = store.slot_nbytes(layout)
    slot = torch.full((slot_nbytes + 3 * ALIGN_BYTES,), 0xA5, dtype=torch.uint8)
    moved = stored.copy_job(slot)()
    assert moved == stored.link_bytes
    assert torch.equal(slot[: layout.nbytes][covered], packed[covered])
    assert torch.all(slot[slot_nbytes:] == 0xA5), "the copy wrote past the block's slot bytes"
    # read through the block's own views of the slot, every tensor is the original, bit for bit
    views = layout.views(slot)
    assert len(views) == len(originals) == len(layout.entries)
    for entry, view, original in zip(layout.entries, views, originals):
        assert torch.equal(_bits(view), original), entry.name
    store.restore_(CPU)
