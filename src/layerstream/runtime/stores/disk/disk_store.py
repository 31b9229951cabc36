"""The disk tier's store: streamed blocks that hold no host memory, read from disk into the slot at every use,
from the checkpoint's own file ranges where its spans are unwritten views of a file mapping, else from a spill
file written once at enable. A float8 or coded block is always spilled and keeps its originals until `commit_`.
A read-ahead thread fills the `StagingRing` along the streamer's predicted order, so that disk, link and compute
run as three stages; alternating DiTs' pooled blocks stay in a `HostPool` entry while their DiT runs. Reads drop
their pages from the page cache (the memory the budget leaves free stays free); a simulated disk keeps the cache.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layerstream.errors import TransferError, UnsupportedUseError
from layerstream.plan.placement import HostPoolChoice, Placement
from layerstream.runtime.contracts import DiskPart, HostStoreBase, Job, Pinner, StoredBlockBase, StoredForm, StoreStats, WholePart
from layerstream.runtime.packing.file_reads import FileRange, FileReader, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout, TensorBinder
from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.forms.slot import SlotUnpack
from layerstream.runtime.stores.disk.host_pool import HostPool
from layerstream.runtime.stores.disk.sources import (
    CheckpointSource,
    SpillSource,
    remove_stale_spill_folders,
    spill_folder_prefix,
)
from layerstream.runtime.stores.disk.staging import READ_AHEAD_DEPTH, StagingRing

logger = logging.getLogger(__name__)

MAX_IN_MEMORY_FRACTION = 1 / 8  # of a file-backed block's bytes made in memory, kept as host bytes; more: spilled


class DiskBlock(StoredBlockBase):
    """One block of the disk tier: no host bytes; its copy job reads it from disk."""

    copy_waits_on_host = True  # for its read: an accelerator engine queues the job on a thread of its own
    entry: int | None = None  # its host pool entry (a `PooledBlock`'s); None: read through the staging ring

    def __init__(
        self,
        store: DiskHostStore,
        part: DiskPart,
        binder: TensorBinder,
        source,
        member: str | None = None,
        originals: list[torch.Tensor] | None = None,
    ):
        self.store = store
        self.member = member  # its alternating DiT, where there is a host pool
        self.part = part
        form = self.form = part.form
        self.layout = form.layout
        self.unpack = SlotUnpack(form)
        self.originals = originals  # kept until the commit where the part cannot give them back (lossy, shard)
        self.binder = binder
        self.source: CheckpointSource | SpillSource = source
        self.original_device = self.layout.source_device()  # staged before its sources are forgotten
        self.disk_wait = (0.0, 0.0)  # when the latest job waited for the disk (perf_counter): count_stall_

    def __repr__(self) -> str:
        return f"DiskBlock({self.path!r}, {self.stored_nbytes} bytes from {self.source.describe()})"

    @property
    def host_bytes(self) -> int:
        return self.source.host_bytes  # at most the few spans made in memory (the staging ring is the store's)

    @property
    def pinned(self) -> bool:
        return False

    @property
    def stored_nbytes(self) -> int:
        return self.part.nbytes  # on disk, in the staging ring and in the pool

    @property
    def link_bytes(self) -> int:
        return self.part.nbytes

    def copy_out_(self, held: torch.Tensor, slot_buffer: torch.Tensor, event) -> int:
        """Move the bytes read into `held` into the slot, record `event` (an asynchronous copy), then unpack."""
        nbytes = self.part.to_slot_(held, slot_buffer, non_blocking=event is not None)
        if event is not None:
            event.record()  # `held` may be read into again once the copy (or gather) out of it is done
        self.unpack.run_(slot_buffer)  # float8: the casts into the compute layout, after the copy on its stream
        return nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        store = self.store

        def job() -> int:
            if store.pool is not None and self.member is not None:
                store.pool.prepare_(self.member)  # the first block of another DiT: the pool reads its blocks
            nbytes = store.staging.copy_(self, slot_buffer, store.upcoming_after(self.path))
            self.disk_wait = store.staging.last_disk_wait  # compute's part of it: count_stall_
            return nbytes

        return job

    def count_stall_(self, stall_seconds: float) -> None:
        started, ended = self.disk_wait  # the part of compute's wait during which the job waited for the disk
        now = time.perf_counter()
        overlap = min(ended, now) - max(started, now - stall_seconds)
        if overlap > 0:
            self.store.disk_stall_seconds += overlap

    def read_into_(self, buffer: torch.Tensor) -> None:
        store = self.store
        gbps = store.simulated_gbps
        if gbps is None:
            nbytes = self.source.read_into_(buffer, store.reader)
        else:
            with store.simulated_disk:  # one disk: concurrent reads take turns
                start = time.perf_counter()
                nbytes = self.source.read_into_(buffer, store.reader)
                remaining = nbytes / (gbps * 1e9) - (time.perf_counter() - start)
                if remaining > 0:
                    time.sleep(remaining)  # the read lasts as long as it would on that disk
        with store.counting:  # the read-ahead and the pool read on threads of their own
            store.disk_bytes_read += nbytes

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._refuse("backward through it")

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._refuse("keep what its forward wrote into its buffers")

    def host_tensors(self) -> list[torch.Tensor]:
        self._refuse("read or write its weights in place (state_dict, load_state_dict, LoRA)")

    _where = "lives on disk (host_budget_gb), not in host memory"

    def _refuse(self, what: str):
        raise UnsupportedUseError(
            f"{self.path}: the block {self._where}; cannot {what}. Raise host_budget_gb so that it fits in host "
            "memory, or call handle.disable() first"
        )


class PooledBlock(DiskBlock):
    """A disk block whose bytes stay in an entry of the host pool while its DiT runs (`runtime.stores.disk.host_pool`)."""

    _where = "is read from disk into a host pool it shares with another DiT (host_budget_gb)"

    def __init__(self, *args, entry: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.entry = entry

    def __repr__(self) -> str:
        return f"PooledBlock({self.path!r}, pool entry {self.entry}, {self.stored_nbytes} bytes from {self.source.describe()})"

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        store = self.store

        def job() -> int:
            waited = time.perf_counter()
            entry = store.pool.take_(self)  # waits only when the pool is still reading it
            self.disk_wait = (waited, time.perf_counter())
            return store.pool.copy_out_(entry, self, slot_buffer)

        return job


class DiskHostStore(HostStoreBase):
    """`HostStore` for the blocks the placement puts on disk (spill files under `root`)."""

    kind = "disk"

    def __init__(
        self,
        root: str | Path,
        simulated_gbps: float | None = None,
        pool: HostPoolChoice | None = None,
        form_of: Callable[[BlockLayout], StoredForm] = PackedForm,
        part_of: Callable[[BlockLayout], DiskPart] | None = None,
    ):
        self.form_of = form_of
        self.part_of: Callable[[BlockLayout], DiskPart] = part_of or (lambda layout: WholePart(form_of(layout)))
        self.simulated_gbps = simulated_gbps  # CPU measurements: every read lasts as long as on such a disk
        self.simulated_disk = threading.Lock()  # held through a simulated read: every reader shares one disk
        self.counting = threading.Lock()  # reads on several threads add to the byte count
        self.pool_choice: HostPoolChoice | None = pool  # given, or from `place_`; None: no pool
        self.pool: HostPool | None = None
        self.root = Path(root).expanduser()
        self._successor: Callable[[str], str | None] | None = None
        self._num_streamed = 0
        self.blocks: dict[str, DiskBlock] = {}
        self.disk_bytes_read = 0
        self.disk_stall_seconds = 0.0
        # a simulated disk stands for the disk: its reads may come from the page cache, the real disk is not timed
        self.reader = FileReader(drop_cached=simulated_gbps is None)
        self.folder: Path | None = None
        self._files: MappedFiles | None = None
        self._staging_nbytes = 0
        self.staging: StagingRing | None = None

    def __repr__(self) -> str:
        spilled = sum(isinstance(b.source, SpillSource) for b in self.blocks.values())
        return f"DiskHostStore({len(self.blocks)} blocks, {spilled} spilled to {self.folder})"

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        # the learned order over every streamed block, not each chain's declared one: the read-ahead follows a
        # model that runs its blocks in another order, and reads into the next component at a hand-over
        self._successor = successor
        self._num_streamed = num_blocks

    def upcoming_after(self, path: str) -> list[DiskBlock]:
        """The staged, unpooled disk blocks predicted to run after `path`, up to `READ_AHEAD_DEPTH`."""
        upcoming: list[DiskBlock] = []
        if self._successor is None:
            return upcoming
        current: str | None = path
        for _ in range(self._num_streamed):  # the predictions may cycle without coming back to `path`
            current = self._successor(current)
            if current is None or current == path:
                break
            block = self.blocks.get(current)
            if block is None or isinstance(block, PooledBlock):
                continue  # a host block (or a pooled one): nothing to read into the ring
            if block in upcoming:
                break
            upcoming.append(block)
            if len(upcoming) == READ_AHEAD_DEPTH:
                break
        return upcoming

    @property
    def staging_nbytes(self) -> int:
        return sum(b.numel() for b in self.staging.buffers) if self.staging is not None else 0

    def host_nbytes(self, layout: BlockLayout) -> int:
        return 0  # a disk block keeps no host bytes (but for the few spans made in memory, counted by the block)

    def place_(self, placement: Placement) -> None:
        self.pool_choice = placement.host_tier.pool if placement.host_tier is not None else None

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        # the ring holds parts: float8 blocks need about half of a bfloat16 block, a rank's shard 1/N of it
        self._staging_nbytes = max((self.part_of(l).nbytes for l in layouts), default=slot_nbytes)

    def stats(self) -> StoreStats:
        pool = self.pool.nbytes if self.pool is not None else 0
        return StoreStats.of_forms(
            (b.form for b in self.blocks.values()),
            host_bytes=pool,
            pinned_host_bytes=pool if self.pool is not None and self.pool.pinned else 0,
            disk_bytes_read=self.disk_bytes_read,
            disk_stall_seconds=self.disk_stall_seconds,
            host_pool_bytes=pool,
            disk_staging_bytes=self.staging_nbytes,
        )

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> DiskBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        if self._files is None:
            remove_stale_spill_folders(self.root)  # once per enable, before this enable writes anything
            self._files = MappedFiles.snapshot()
        if self.staging is None:
            self.staging = StagingRing(self._staging_nbytes, device, pin)
        part = self.part_of(layout)
        form = part.form
        compute = form.layout
        choice = self.pool_choice
        entry = choice.entry_of(layout.path) if choice is not None else None
        if entry is not None and self.pool is None:
            self.pool = HostPool(choice.entry_nbytes, choice.member_blocks, device, pin)
        packed = None
        if entry is not None and self.pool.owner(entry) is None:  # the entry starts with this block's bytes
            packed = self.pool.buffers[entry][: part.nbytes].zero_()  # zeroed pads: a spill file's bytes are defined
            part.fill_(packed, self._files, self.reader)
        source = self._checkpoint_source(compute, part) if form.stored_is_packed else None  # a float8 or coded form's bytes are not the file's
        if source is None:
            source = self._spill_(part, packed)
        binder = TensorBinder(compute, device)
        member = choice.member_of(layout.path) if choice is not None else None
        # the original tensors go now, or stay until the commit for a rollback that reads nothing (lossy, shard)
        originals = binder.current_tensors() if part.keeps_originals else None
        if entry is not None:
            block = PooledBlock(self, part, binder, source, member, originals, entry=entry)
            self.pool.add_(block, holds_bytes=packed is not None)
        else:
            block = DiskBlock(self, part, binder, source, member, originals)
        block.binder.evict_()
        if not part.keeps_originals:
            compute.forget_sources()  # the block's memory (or its view of the checkpoint) goes now
        part.staged_(block)
        self.blocks[layout.path] = block
        return block

    def _checkpoint_source(self, layout: BlockLayout, part: DiskPart) -> CheckpointSource | None:
        """The checkpoint's own file ranges that fall into the part's window; None: spill the block."""
        spans = layout.span_file_ranges(self._files)
        in_memory = [(dst, length) for source, dst, length in spans if source is None and length > 0]
        if len(in_memory) == len(spans) or sum(n for _, n in in_memory) > MAX_IN_MEMORY_FRACTION * layout.nbytes:
            return None
        ranges, chunks = [], []
        for source, dst, length in spans:
            lo, hi = max(dst, part.start), min(dst + length, part.start + part.nbytes)
            if lo >= hi:
                continue  # the span lies outside this part
            if source is not None:
                ranges.append((FileRange(source.path, source.offset + lo - dst, hi - lo), lo - part.start))
            else:
                chunk = torch.empty(hi - lo, dtype=torch.uint8)
                layout.copy_range_into(chunk, lo)
                chunks.append((chunk, lo - part.start))
        return CheckpointSource(ranges, chunks)

    def _spill_(self, part: DiskPart, packed: torch.Tensor | None = None) -> SpillSource:
        if self.folder is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # one folder per enable: processes (and pipelines) sharing disk_dir never touch each other's files;
            # named after this process, so that a later enable can tell whether it still runs
            self.folder = Path(tempfile.mkdtemp(prefix=spill_folder_prefix(), dir=self.root))
        buffer = packed
        if buffer is None:  # (the bytes already stored for a pool entry are written as they are)
            buffer = torch.zeros(part.nbytes, dtype=torch.uint8)  # zeroed pads: the file's bytes are all defined
            part.fill_(buffer, self._files, self.reader)
        path = part.form.layout.path
        name = f"{len(self.blocks):05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', path)}.block"
        return SpillSource.write(self.folder / name, buffer)

    def commit_(self) -> None:
        self._close_files_()
        for block in self.blocks.values():
            if block.originals is not None:
                block.originals = None  # from here on the stored bytes are the only copy
                block.layout.forget_sources()

    def _close_files_(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None

    def rollback_(self) -> None:
        self._close_files_()
        self.stop_reading_()
        try:
            self._restore_blocks_(lambda block: block.original_device)
        finally:
            self._release_()

    def restore_(self, device: torch.device) -> None:
        self.stop_reading_()  # first: a read-ahead (or pool read) in flight uses the reader the restore reads with
        try:
            self._restore_blocks_(lambda block: device)
        finally:
            self._release_()

    def stop_reading_(self) -> None:
        """Stop reading ahead and free the staging ring and the pool (before any restore reads with the reader)."""
        try:
            if self.staging is not None:
                self.staging.close_()
                self.staging = None
        finally:
            if self.pool is not None:
                self.pool.close_()
                self.pool = None

    def _restore_blocks_(self, device_of) -> None:
        """Every block gets real tensors again, read from disk; the first failure is raised after the rest."""
        first_error: BaseException | None = None
        for path in list(self.blocks):
            block = self.blocks.pop(path)
            block.unpack.clear_()
            if block.originals is not None:  # a rollback before the commit: the very tensors it had
                block.binder.bind_(block.originals)
                continue
            if block.part.restored_by_host_store:
                continue  # a collective restore, in its peers' order: its host store restored it (or could not)
            buffer = torch.empty(block.stored_nbytes, dtype=torch.uint8)
            try:
                block.read_into_(buffer)
            except (OSError, TransferError) as e:
                logger.error("%s: cannot be read back from disk: %s", path, e)
                first_error = first_error or e
                continue
            compute = block.part.compute_bytes(buffer)  # float8: upcast (exact) from the stored bytes
            block.binder.bind_(block.layout.separate_copies(compute, device_of(block)))
        if first_error is not None:
            raise first_error

    def release_(self) -> None:
        for block in self.blocks.values():
            block.unpack.clear_()
        self.blocks.clear()
        self._release_()

    def _release_(self) -> None:
        self.stop_reading_()  # the engine is closed: nothing reads any more
        self.reader.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
