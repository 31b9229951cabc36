"""The disk tier (`host_budget_gb`): blocks beyond the host budget are read from disk at every use.

An in-memory pipeline spills them to checked files under `disk_dir`; outputs stay bit-identical to resident,
host bytes stay within the budget (by the runtime's own accounting), a corrupt or truncated spill file is a
clear error naming it, and `disable()` removes the files and brings every weight back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from layerstream import enable_offload
from layerstream.errors import TransferError
from layerstream.runtime.stores.disk.sources import HEADER_BYTES, SpillFileError
from layerstream.runtime.packing.layout import BlockLayout
from runtime_toys import make_my_pipeline, run, snapshot, toy_inputs

BOTH = ["dit", "text_encoder"]


def _block_nbytes(pipe) -> dict[str, int]:
    blocks = {f"transformer.blocks.{i}": b for i, b in enumerate(pipe.transformer.blocks)}
    blocks |= {f"prompt_model.encoder.layers.{i}": b for i, b in enumerate(pipe.prompt_model.encoder.layers)}
    return {p: BlockLayout(p, b).nbytes for p, b in blocks.items()}


def _config(budget_bytes: int, disk_dir: Path | None = None) -> dict:
    config = {"mode": "layer", "components": BOTH, "host_budget_gb": budget_bytes / 1e9}
    if disk_dir is not None:
        config["disk_dir"] = str(disk_dir)
    return config


def _spill_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_blocks_beyond_the_budget_stream_from_spill_files_bit_identically(tmp_path):
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    before = snapshot(pipe)
    sizes = _block_nbytes(pipe)
    budget = 3 * max(sizes.values())  # three of the seven streamed blocks fit
    handle = enable_offload(pipe, _config(budget, tmp_path), device="cpu")
    tier = handle.placement.host_tier
    assert len(tier.host_block_paths) == 3 and len(tier.disk_block_paths) == 4
    assert len(_spill_files(tmp_path)) == 4  # one checked file per disk block, written once at enable
    for _ in range(3):  # the cyclic order of denoising steps: the same fixed blocks come from disk every time
        assert torch.equal(run(pipe, (ids, x)), expected)
    stats = handle.stats()
    assert stats.host_bytes <= budget  # the runtime's own accounting: only host-resident bytes
    assert stats.host_bytes == sum(sizes[p] for p in tier.host_block_paths)
    transfers = handle.block_transfers()
    assert all(transfers[p] >= 3 for p in tier.disk_block_paths)
    issued = sum(transfers[p] * sizes[p] for p in tier.disk_block_paths)
    # bytes count when read; the last block's prefetch of the first may still be reading on the copy thread, and
    # the read-ahead follows each chain, so where one component's chain hands over to the other's, a block read
    # ahead is not the one that runs next and is read again
    assert issued - max(sizes.values()) <= stats.disk_bytes_read <= 2 * issued
    assert "read from disk" in str(stats)
    handle.disable()
    assert _spill_files(tmp_path) == []  # the spill files go with disable
    after = snapshot(pipe)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every weight back, bit for bit
    assert torch.equal(run(pipe, (ids, x)), expected)


def test_without_a_budget_nothing_goes_to_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path))
    pipe = make_my_pipeline()
    sizes = _block_nbytes(pipe)
    handle = enable_offload(pipe, {"mode": "layer", "components": BOTH}, device="cpu")
    stats = handle.stats()
    assert handle.placement.host_tier is None and stats.disk_bytes_read == 0
    assert stats.host_bytes == sum(sizes.values())
    assert not (tmp_path / "spill").exists()
    handle.disable()


def test_spill_files_go_under_the_layerstream_cache_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path))
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, _config(1), device="cpu")  # a budget below any block: every block on disk
    assert len(_spill_files(tmp_path / "spill")) == 7
    assert torch.equal(run(pipe, (ids, x)), expected)
    assert handle.stats().host_bytes == 0
    handle.disable()
    assert _spill_files(tmp_path) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_spill_file_is_a_clear_error_naming_it(tmp_path, damage):
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, _config(1, tmp_path), device="cpu")
    victim = _spill_files(tmp_path)[2]
    original = victim.read_bytes()
    if damage == "flip":
        data = bytearray(original)
        data[HEADER_BYTES + 100] ^= 0x01  # one bit of one weight
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(original[: len(original) // 2])
    else:
        victim.unlink()
    with pytest.raises(TransferError, match=victim.name) as info:
        run(pipe, (ids, x))
    assert isinstance(info.value, SpillFileError) or isinstance(info.value.__cause__, SpillFileError)
    victim.write_bytes(original)  # repaired: the ring is usable again and gives the right picture
    assert torch.equal(run(pipe, (ids, x)), expected)
    handle.disable()
    assert _spill_files(tmp_path) == []


def test_a_spill_file_damaged_before_disable_fails_disable_naming_it_and_removes_the_files(tmp_path):
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _config(1, tmp_path), device="cpu")
    victim = _spill_files(tmp_path)[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(SpillFileError, match=victim.name):
        handle.disable()
    assert _spill_files(tmp_path) == []


def test_a_failed_enable_removes_its_spill_files_and_restores_the_weights(tmp_path):
    pipe = make_my_pipeline()
    before = snapshot(pipe)

    def failing_engine(device, num_slots):
        raise RuntimeError("no engine today")

    with pytest.raises(Exception, match="no engine today"):
        enable_offload(pipe, _config(1, tmp_path), device="cpu", engine_factory=failing_engine)
    assert _spill_files(tmp_path) == []
    after = snapshot(pipe)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_state_dict_of_a_disk_block_is_refused_with_the_reason(tmp_path):
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _config(1, tmp_path), device="cpu")
    with pytest.raises(Exception, match="lives on disk"):
        pipe.transformer.state_dict()
    handle.disable()


@pytest.mark.parametrize("source", ["checkpoint", "in-memory"])
def test_tiny_wan_with_half_its_blocks_on_disk_generates_bit_identically(tmp_path, source):
    """Loaded from its folder, the disk blocks are read from the checkpoint's files (no spill file); built in
    memory (here: weights copied out of the files' mapping), they are spilled under disk_dir."""
    pytest.importorskip("diffusers")
    from tiny_pipelines import generate, load_wan

    expected = generate(load_wan(source), "wan")  # the same weights resident, at the same addresses
    pipe = load_wan(source)
    experts = [pipe.transformer, pipe.transformer_2]
    sizes = [BlockLayout("b", b).nbytes for m in experts for b in m.blocks]
    budget = sum(sizes) // 4  # the streamed bytes are four times the budget
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"], "host_budget_gb": budget / 1e9, "disk_dir": str(tmp_path)}, device="cpu")
    tier = handle.placement.host_tier
    assert tier.disk_block_paths and tier.pool.block_paths  # the experts share their host memory (test_host_pool)
    assert {p.split(".")[0] for p in tier.disk_block_paths} == {"transformer", "transformer_2"}  # both experts
    num_spilled = len(_spill_files(tmp_path))
    assert num_spilled == (0 if source == "checkpoint" else len(tier.from_disk_paths))
    got = generate(pipe, "wan")  # two experts, classifier-free guidance
    stats = handle.stats()
    assert stats.host_bytes <= budget and stats.disk_bytes_read > 0
    handle.disable()
    assert torch.equal(got, expected)
    assert _spill_files(tmp_path) == []


def _staged_on_disk(pipe, tmp_path):
    """The DiT blocks of `pipe` in a disk store of their own (spilled), and each block's packed bytes."""
    from layerstream.runtime.stores.disk.disk_store import DiskHostStore

    layouts = [BlockLayout(f"b{i}", b) for i, b in enumerate(pipe.transformer.blocks)]
    packed = []
    for layout in layouts:
        buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
        layout.copy_sources_into(buffer)
        packed.append(buffer)
    store = DiskHostStore(tmp_path)
    slot_nbytes = max(l.nbytes for l in layouts)
    store.check_layouts_(layouts, slot_nbytes)
    stored = [store.stage_(layout, torch.device("cpu"), None) for layout in layouts]
    store.commit_()
    return store, stored, packed, slot_nbytes


def test_the_staging_ring_reads_ahead_along_the_chain(tmp_path):
    """Disk -> staging buffer -> slot, reading the next disk blocks ahead on an I/O thread; a ring for a device
    without CUDA events copies into the slot in step."""
    from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS, StagingRing

    store, stored, packed, slot_nbytes = _staged_on_disk(make_my_pipeline(), tmp_path)
    ring = StagingRing(slot_nbytes, torch.device("meta"), None)
    assert len(ring.buffers) == NUM_STAGING_BUFFERS and all(b.numel() == slot_nbytes for b in ring.buffers)
    slot = torch.empty(slot_nbytes, dtype=torch.uint8)
    n = len(stored)
    for _ in range(3):  # the cyclic order of steps: after the very first block, every read was done ahead
        for k, (block, want) in enumerate(zip(stored, packed)):
            assert ring.copy_(block, slot, [stored[(k + 1) % n], stored[(k + 2) % n]]) == block.layout.nbytes
            assert torch.equal(slot[: want.numel()], want)
    assert (ring.num_read_ahead_hits, ring.num_read_ahead_misses) == (3 * n - 1, 0)
    # a changed order: a skipped block's read is dropped and the next one used; a block not read ahead is read
    # in step
    for k in (0, 2, 1):
        ring.copy_(stored[k], slot, [stored[(k + 1) % n], stored[(k + 2) % n]])
        assert torch.equal(slot[: packed[k].numel()], packed[k])
    assert ring.num_read_ahead_misses == 2
    ring.close_()
    store.restore_(torch.device("cpu"))
    assert _spill_files(tmp_path) == []


def test_a_disk_job_counts_as_disk_stall_only_the_part_of_computes_wait_it_spent_reading(tmp_path):
    """A job counts nothing itself, wherever it runs: the streamer tells the block how long compute waited for
    its copy, or spent queuing it (`count_stall_`), and the block counts the part of that time during which its
    job was waiting for the disk."""
    store, stored, packed, slot_nbytes = _staged_on_disk(make_my_pipeline(), tmp_path)
    store.simulated_gbps = 0.001  # 1 MB/s: a ~17 KB block takes ~17 ms to read
    host_slot = torch.empty(slot_nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    assert stored[0].copy_job(host_slot)() == stored[0].layout.nbytes  # nothing read ahead: read in step
    spent = time.perf_counter() - start
    assert store.disk_stall_seconds == 0.0
    stored[0].count_stall_(spent)  # compute ran the job itself (queuing it): all of its read was compute's wait
    assert 0.9 * stored[0].layout.nbytes / 1e6 <= store.disk_stall_seconds <= spent
    before = store.disk_stall_seconds
    time.sleep(0.01)
    stored[0].count_stall_(0.005)  # a later wait, for the link only: no disk in it
    assert store.disk_stall_seconds == before
    assert torch.equal(host_slot[: packed[0].numel()], packed[0])
    store.restore_(torch.device("cpu"))


def test_a_damaged_block_read_ahead_is_an_error_when_it_is_used_not_before(tmp_path):
    from layerstream.runtime.stores.disk.staging import StagingRing

    store, stored, packed, slot_nbytes = _staged_on_disk(make_my_pipeline(), tmp_path)
    ring = StagingRing(slot_nbytes, torch.device("meta"), None)
    slot = torch.empty(slot_nbytes, dtype=torch.uint8)
    victim = stored[1].source.path
    victim.write_bytes(victim.read_bytes()[:-3])
    ring.copy_(stored[0], slot, [stored[1]])  # the read-ahead of block 1 fails on the I/O thread: nothing yet
    ring.copy_(stored[2], slot, [stored[3]])  # a miss: block 1's failed read is dropped, not raised here
    assert torch.equal(slot[: packed[2].numel()], packed[2])
    ring.copy_(stored[3], slot, [stored[1]])
    with pytest.raises(SpillFileError, match=victim.name):
        ring.copy_(stored[1], slot, [stored[2]])
    ring.close_()
    with pytest.raises(SpillFileError):
        store.restore_(torch.device("cpu"))


def test_a_checkpoint_file_changed_after_enable_is_a_clear_error(tmp_path):
    pytest.importorskip("diffusers")
    import os
    import shutil

    from layerstream.models.loading import load_pipeline, resolve_model_folder
    from layerstream.runtime.stores.disk.sources import CheckpointChangedError
    from tiny_pipelines import generate

    folder = tmp_path / "wan"
    shutil.copytree(resolve_model_folder("tiny-wan"), folder)
    pipe = load_pipeline(str(folder))
    pipe.set_progress_bar_config(disable=True)
    expected_weights = snapshot(pipe.transformer)
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"], "host_budget_gb": 1e-9}, device="cpu")
    assert handle.stats().host_bytes == 0 and not list(tmp_path.rglob("*.block"))  # read from the checkpoint
    victim = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    before = os.stat(victim)
    with open(victim, "ab") as f:
        f.write(b"\0" * 8)  # the checkpoint rewritten under a running pipeline
    with pytest.raises(CheckpointChangedError, match=str(victim)):
        generate(pipe, "wan")
    os.truncate(victim, before.st_size)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))  # as it was: reads work again
    handle.disable()
    after = snapshot(pipe.transformer)
    assert all(torch.equal(after[k], v) for k, v in expected_weights.items())


def test_the_accelerator_engine_streams_disk_blocks_and_reports_a_bad_file_at_wait_ready(tmp_path):
    """The accelerator engine (its CUDA calls recorded by a stand-in) runs disk jobs on its issuing thread:
    outputs bit-identical, only host blocks and the staging ring are registered (pinned), a damaged spill file is a TransferError."""
    from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
    from test_accelerator_protocol import Recorder

    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    sizes = _block_nbytes(pipe)
    recorder = Recorder()

    def factory(device, num_slots):
        return AcceleratorCopyEngine(device, num_slots, api=recorder)

    budget = 2 * max(sizes.values())
    handle = enable_offload(pipe, _config(budget, tmp_path), device="cpu", engine_factory=factory)
    from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS

    registered = [e for e in recorder.log if e[0] == "host_register"]
    # the host blocks and the staging ring the disk blocks are read into are pinned; disk blocks are not
    assert len(handle.placement.host_tier.host_block_paths) == 2
    assert len(registered) == 2 + NUM_STAGING_BUFFERS
    for _ in range(2):
        assert torch.equal(run(pipe, (ids, x)), expected)
    victim = _spill_files(tmp_path)[-1]
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(TransferError, match=victim.name):
        run(pipe, (ids, x))
    with pytest.raises(SpillFileError):
        handle.disable()
    assert _spill_files(tmp_path) == []


def test_a_simulated_disk_makes_reads_last_as_long_as_on_that_disk(tmp_path):
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    gbps = 0.0005  # 0.5 MB/s: a ~17 KB block takes ~35 ms to read
    handle = enable_offload(pipe, _config(1, tmp_path), device="cpu", simulated_disk_gbps=gbps)
    assert torch.equal(run(pipe, (ids, x)), expected)  # the first forward learns the order
    handle.reset_trace()
    before = handle.stats()
    assert torch.equal(run(pipe, (ids, x)), expected)
    after = handle.stats()
    copies = handle.trace().lane("copy")
    sizes = sorted(b.host.layout.nbytes for b in handle.streamer.blocks)  # every block is on disk here
    # one disk reads one block at a time: the forward's copies span at least every read but one (read ahead)
    assert copies and max(c.end for c in copies) - min(c.start for c in copies) >= 0.9 * sum(sizes[:-1]) / (gbps * 1e9)
    # compute (microseconds a block) waited on the disk, and that wait is part of the total stall
    disk_stall = after.disk_stall_seconds - before.disk_stall_seconds
    assert 0 < disk_stall <= after.stall_seconds - before.stall_seconds
    handle.disable()
    with pytest.raises(Exception, match="simulated_disk_gbps = 0 is not valid"):
        enable_offload(make_my_pipeline(), _config(1, tmp_path), device="cpu", simulated_disk_gbps=0)


def test_enable_removes_spill_folders_of_dead_processes_and_never_a_live_ones(tmp_path):
    """A process that died before `disable()` leaves its spill folder; the next enable under the same disk_dir
    removes it, and leaves the folders of live processes (this one, another), of other pid namespaces or
    machines, and anything else alone."""
    import os
    import subprocess
    import sys

    from layerstream.processes import process_space, process_start_ticks

    def folder(name: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "00000-blocks.0.block").write_bytes(b"\0" * 64)
        return path

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    assert ended.wait() == 0
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        me, space = os.getpid(), process_space()
        foreign = "00000000" if space != "00000000" else "11111111"
        dead = folder(f"enable-{space}-{ended.pid}-12345-abc")
        elsewhere = folder(f"enable-{foreign}-{ended.pid}-12345-abc")  # the same pid, in another pid namespace
        reused = folder(f"enable-{space}-{me}-{(process_start_ticks(me) or 0) + 1}-def")  # this pid, an earlier process
        mine = folder(f"enable-{space}-{me}-{process_start_ticks(me) or 0}-ghi")
        other = folder(f"enable-{space}-{live.pid}-{process_start_ticks(live.pid) or 0}-jkl")
        unrelated = folder("not-a-spill-folder")
        handle = enable_offload(make_my_pipeline(), _config(1, tmp_path), device="cpu")
        assert not dead.exists()
        if sys.platform.startswith("linux"):  # /proc tells a reused pid apart
            assert not reused.exists()
        assert mine.exists() and other.exists() and elsewhere.exists() and unrelated.exists()
        ours = [p for p in tmp_path.iterdir() if p.name.startswith(f"enable-{space}-{me}-") and p not in (mine, reused)]
        assert len(ours) == 1 and any(ours[0].iterdir())  # this enable's folder, named after this process
        handle.disable()
        assert not ours[0].exists() and mine.exists() and other.exists()
    finally:
        live.communicate(b"")
    assert live.returncode == 0  # it read its input to the end and exited


def test_disk_reads_leave_no_pages_in_the_page_cache_unless_the_disk_is_simulated(tmp_path):
    """A spill file is dropped from the page cache once written, and the disk tier's reader drops what it read:
    the memory the budget leaves free stays free, and reads reach the disk. A simulated disk keeps the cache
    (the real disk must not be what a CPU measurement times)."""
    from layerstream.runtime.stores.disk.disk_store import DiskHostStore
    from layerstream.runtime.stores.disk.sources import SpillSource
    from layerstream.runtime.packing.file_reads import FileReader
    from tests.benchmark_modules import benchmark_module

    cached_fraction = benchmark_module("page_cache").cached_fraction

    payload = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    path = tmp_path / "block"
    source = SpillSource.write(path, payload)
    fraction = cached_fraction([path])
    if fraction is None:
        pytest.skip("mincore cannot tell what is cached here")
    if fraction > 0.5:
        pytest.skip(f"this filesystem keeps dropped pages cached ({tmp_path} may be tmpfs)")
    assert fraction < 0.01  # written, on disk, not in memory
    out = torch.empty_like(payload)
    for drop_cached, most in ((True, 0.01), (False, 1.0)):
        reader = FileReader(drop_cached=drop_cached)
        assert source.read_into_(out, reader) == payload.numel() and torch.equal(out, payload)  # checked read
        reader.close()
        cached = cached_fraction([path])
        assert (cached < most) if drop_cached else (cached > 0.99), (drop_cached, cached)
    for simulated in (None, 1.0):
        store = DiskHostStore(tmp_path, simulated_gbps=simulated)
        assert store.reader.drop_cached == (simulated is None)
        store.reader.close()


def test_before_any_call_the_read_ahead_reads_the_chains_next_disk_blocks_cyclic(tmp_path):
    """The streamer's first predictions are the declared chain order: after a disk block the read-ahead names the
    chain's next disk blocks, past the host blocks between them, and the last one's successor is the first."""
    pipe = make_my_pipeline()
    sizes = _block_nbytes(pipe)
    dit = [f"transformer.blocks.{i}" for i in range(4)]
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 2 * max(sizes[p] for p in dit) / 1e9, "disk_dir": str(tmp_path)}
    handle = enable_offload(pipe, config, device="cpu")
    tier = handle.placement.host_tier
    assert tier.host_block_paths == (dit[1], dit[3]) and tier.disk_block_paths == (dit[0], dit[2])
    store = handle.streamer.blocks[0].host.store
    assert [b.path for b in store.upcoming_after(dit[0])] == [dit[2]]  # then dit[0] again: the walk stops there
    assert [b.path for b in store.upcoming_after(dit[2])] == [dit[0]]  # the last runs before the first
    handle.disable()


@pytest.mark.parametrize("follow", [True, False])
def test_the_read_ahead_follows_the_order_blocks_run_in_across_components(tmp_path, monkeypatch, follow):
    """Every block on disk, two components (the encoder runs, then the DiT): along each chain's declared order the
    read-ahead at the end of one component reads its own first blocks, not the other's, and misses at every
    hand-over; along the streamer's learned predictions it misses nothing once the order is learned. (With
    `follow` False the streamer learns nothing, so its predictions stay the declared order: the old behaviour,
    for contrast.)"""
    from layerstream.runtime.streaming.streamer import BlockStreamer

    if not follow:
        monkeypatch.setattr(BlockStreamer, "_learn", lambda self, last, index: None)
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, _config(1, tmp_path), device="cpu")
    assert len(handle.placement.host_tier.disk_block_paths) == 7
    ring = handle.streamer.blocks[0].host.store.staging
    misses = []
    for _ in range(4):
        assert torch.equal(run(pipe, (ids, x)), expected)
        misses.append(ring.num_read_ahead_misses)
    handle.disable()
    new_misses = misses[3] - misses[1]  # after the first two calls taught the order
    assert (new_misses == 0) if follow else (new_misses >= 2), misses
