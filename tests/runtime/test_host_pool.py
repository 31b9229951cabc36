"""The host pool of the disk tier: DiTs that run one after the other (Wan 2.2's experts) share host memory under
`host_budget_gb`, so the one not running holds none.

Each pooled block copies from its pool entry while its DiT runs; the first block of the other DiT makes the
pool read the newcomer's pooled blocks from disk (checked, as every disk read). Outputs stay bit-identical to
resident, whichever order the DiTs run in, host bytes stay within the budget by the runtime's own accounting,
and a damaged file is a clear error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerstream import enable_offload
from layerstream.errors import TransferError, UnsupportedUseError
from layerstream.plan.placement import HostPoolChoice
from layerstream.runtime.stores.disk.disk_store import DiskHostStore, PooledBlock
from layerstream.runtime.stores.disk.sources import SpillFileError
from layerstream.runtime.packing.layout import BlockLayout
from runtime_toys import make_my_pipeline

CPU = torch.device("cpu")


def _spill_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


class _Pooled:
    """Four toy DiT blocks in a disk store with a pool: members "a" (blocks 0, 1) and "b" (blocks 2, 3); blocks
    0 and 2 share pool entry 0, blocks 1 and 3 are plain disk blocks."""

    def __init__(self, tmp_path: Path):
        pipe = make_my_pipeline()
        layouts = [BlockLayout(f"b{i}", b) for i, b in enumerate(pipe.transformer.blocks)][:4]
        self.packed = []
        for layout in layouts:
            buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
            layout.copy_sources_into(buffer)
            self.packed.append(buffer)
        choice = HostPoolChoice(
            members=("a", "b"),
            entries=(("b0", "b2"),),
            entry_nbytes=(max(layouts[0].nbytes, layouts[2].nbytes),),
            member_blocks={"a": ("b0", "b1"), "b": ("b2", "b3")},
        )
        self.store = DiskHostStore(tmp_path, pool=choice)
        self.slot_nbytes = max(l.nbytes for l in layouts)
        self.store.check_layouts_(layouts, self.slot_nbytes)
        self.blocks = [self.store.stage_(layout, CPU, None) for layout in layouts]
        self.store.commit_()
        self.slot = torch.empty(self.slot_nbytes, dtype=torch.uint8)

    def run(self, k: int) -> bool:
        """Run block k's copy job; whether the slot then holds its bytes."""
        assert self.blocks[k].copy_job(self.slot)() == self.packed[k].numel()
        return torch.equal(self.slot[: self.packed[k].numel()], self.packed[k])


def test_pooled_blocks_share_an_entry_read_again_only_when_the_other_dit_ran(tmp_path):
    pooled = _Pooled(tmp_path)
    pool = pooled.store.pool
    assert [type(b) for b in pooled.blocks] == [PooledBlock, type(pooled.blocks[1]), PooledBlock, type(pooled.blocks[3])]
    assert not isinstance(pooled.blocks[1], PooledBlock)
    assert pool.owner(0) is pooled.blocks[0] and pool.current == "a"  # the first DiT staged starts in the pool
    assert pool.nbytes == pooled.packed[0].numel() == pooled.packed[2].numel()
    for _ in range(2):  # "a" runs: its pooled block comes from host memory, nothing is read for it
        assert pooled.run(0) and pooled.run(1)
    assert pool.bytes_loaded == 0 and pool.num_member_changes == 0
    for _ in range(2):  # "b" runs: its pooled block is read once, at the change
        assert pooled.run(2) and pooled.run(3)
    assert pool.bytes_loaded == pooled.packed[2].numel() and pool.num_member_changes == 1 and pool.owner(0) is pooled.blocks[2]
    # "a" again, starting with its disk block: that first block already sends the pool reading "a"'s blocks
    assert pooled.run(1)
    assert pool.current == "a" and pool.num_member_changes == 2
    assert pooled.run(0)
    assert pool.bytes_loaded == pooled.packed[2].numel() + pooled.packed[0].numel()
    # interleaved (a model that does not alternate as declared): slow, never wrong
    for k in (2, 0, 2, 0, 3, 1):
        assert pooled.run(k)
    pooled.store.restore_(CPU)
    assert pooled.store.pool is None and _spill_files(tmp_path) == []


def test_a_damaged_pooled_block_is_an_error_naming_its_file_when_it_is_read(tmp_path):
    pooled = _Pooled(tmp_path)
    pool = pooled.store.pool
    victim = pooled.blocks[2].source.path
    whole = victim.read_bytes()
    victim.write_bytes(whole[:-5])
    assert pooled.run(0)  # "a" is in the pool: nothing is read, nothing fails
    with pytest.raises(SpillFileError, match=victim.name):
        pooled.run(2)
    assert pool.owner(0) is None and pool.num_member_changes == 1  # nothing half-read stays in the entry
    victim.write_bytes(whole)
    assert pooled.run(2)  # the same DiT asks again: read again, no change of DiT counted
    assert pool.num_member_changes == 1
    victim.write_bytes(whole[:-5])
    assert pooled.run(0)  # the other DiT's block is read back into the entry
    with pytest.raises(SpillFileError, match=victim.name):
        pooled.store.restore_(CPU)
    assert _spill_files(tmp_path) == []


def _wan(source: str):
    pytest.importorskip("diffusers")
    from tiny_pipelines import load_wan

    return load_wan(source)


@pytest.mark.parametrize("source", ["checkpoint", "in-memory"])
def test_wan_experts_each_keep_what_the_whole_budget_holds_and_generate_bit_identically(tmp_path, source):
    """The streamed bytes are about three times the budget: one third of the blocks fits. Each expert keeps two of its
    three blocks in host memory while it runs (the static split would give each one), the other expert none."""
    from tiny_pipelines import generate

    expected = generate(_wan(source), "wan")  # the same weights resident, at the same addresses
    pipe = _wan(source)
    experts = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    sizes = {f"{name}.blocks.{i}": BlockLayout("b", b).nbytes for name, m in experts.items() for i, b in enumerate(m.blocks)}
    budget = sum(sizes.values()) * 34 // 100  # (a little above a third: slots are aligned)
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": budget / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(pipe, config, device="cpu")
    tier = handle.placement.host_tier
    pool = tier.pool
    assert pool is not None and pool.members == ("transformer", "transformer_2")
    assert [sorted(p.split(".")[0] for p in entry) for entry in pool.entries] == [["transformer", "transformer_2"]] * 2
    assert tier.host_block_paths == ()  # every host byte is the pool's
    num_spilled = len(_spill_files(tmp_path))
    # from the folder nothing is written; in memory every block of both experts gets its checked file
    assert num_spilled == (0 if source == "checkpoint" else len(sizes))
    blocks = {b.path: b.host for b in handle.streamer.blocks}
    store = next(iter(blocks.values())).store
    for _ in range(2):  # one request runs transformer, then transformer_2; the next one transformer again
        assert torch.equal(generate(pipe, "wan"), expected)
    stats = handle.stats()
    assert stats.host_pool_bytes == store.pool.nbytes == pool.nbytes
    assert stats.host_bytes == stats.host_pool_bytes <= budget  # the runtime's own accounting
    assert stats.disk_staging_bytes == store.staging_nbytes > 0
    # three changes of expert (to transformer_2, back, to transformer_2 again), each reading two pooled blocks
    assert store.pool.num_member_changes == 3
    pooled_nbytes = {m: sum(blocks[p].layout.nbytes for p in pool.block_paths if p.startswith(m + ".")) for m in pool.members}
    assert store.pool.bytes_loaded == 2 * pooled_nbytes["transformer_2"] + pooled_nbytes["transformer"]
    with pytest.raises(UnsupportedUseError, match="host pool"):
        pipe.transformer.state_dict()
    handle.disable()
    assert _spill_files(tmp_path) == []
    assert torch.equal(generate(pipe, "wan"), expected)


def test_wan_pool_on_the_accelerator_engine_is_pinned_and_a_bad_file_is_a_transfer_error(tmp_path):
    """The accelerator engine (its CUDA calls recorded by a stand-in) runs pooled blocks' jobs on its issuing
    thread: the pool entries are pinned with the staging ring, outputs are bit-identical, and a damaged spill
    file of the expert not in the pool fails its first use with the file's name."""
    from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
    from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS
    from test_accelerator_protocol import Recorder
    from tiny_pipelines import generate

    expected = generate(_wan("in-memory"), "wan")  # the same weights resident, at the same addresses
    pipe = _wan("in-memory")
    recorder = Recorder()
    sizes = [BlockLayout("b", b).nbytes for m in (pipe.transformer, pipe.transformer_2) for b in m.blocks]
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": sum(sizes) * 34 // 100 / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(
        pipe, config, device="cpu", engine_factory=lambda device, n: AcceleratorCopyEngine(device, n, api=recorder)
    )
    pool = handle.placement.host_tier.pool
    registered = [e for e in recorder.log if e[0] == "host_register"]
    assert len(registered) == len(pool.entries) + NUM_STAGING_BUFFERS
    assert handle.stats().pinned_host_bytes == pool.nbytes
    assert torch.equal(generate(pipe, "wan"), expected)
    # transformer_2 ran last and holds the pool: damage a pooled block of transformer, used first next request
    victim_block = next(p for p in pool.block_paths if p.startswith("transformer."))
    victim = next(b.host.source.path for b in handle.streamer.blocks if b.path == victim_block)
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(TransferError, match=victim.name):
        generate(pipe, "wan")
    with pytest.raises(SpillFileError):
        handle.disable()
    assert _spill_files(tmp_path) == []


def test_wan_with_budget_beyond_one_expert_keeps_the_first_blocks_for_the_whole_run(tmp_path):
    """Four of the six blocks fit: the pool holds each expert whole (three entries) and the fourth block's worth
    of budget keeps the first block of both experts for the whole run (two entries left in the pool)."""
    from tiny_pipelines import generate

    expected = generate(_wan("in-memory"), "wan")  # the same weights resident, at the same addresses
    pipe = _wan("in-memory")
    sizes = [BlockLayout("b", b).nbytes for m in (pipe.transformer, pipe.transformer_2) for b in m.blocks]
    budget = sum(sizes) * 68 // 100
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": budget / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(pipe, config, device="cpu")
    tier = handle.placement.host_tier
    assert tier.host_block_paths == ("transformer.blocks.0", "transformer_2.blocks.0") and tier.disk_block_paths == ()
    assert len(tier.pool.entries) == 2
    for _ in range(2):
        assert torch.equal(generate(pipe, "wan"), expected)
    stats = handle.stats()
    assert stats.host_bytes <= budget and stats.host_pool_bytes == tier.pool.nbytes
    handle.disable()
    assert torch.equal(generate(pipe, "wan"), expected)
