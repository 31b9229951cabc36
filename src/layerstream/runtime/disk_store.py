"""The disk tier: streamed blocks that hold no host memory, read from disk into the slot at every use.

A block placed on disk (`Placement.host_tier`) comes from one of two places:
- **the checkpoint's own files**, when the block's spans are unwritten views of a file mapping (diffusers loaded
  it lazily from safetensors): the store records the file ranges and keeps no copy of them. A few spans the
  loader made in memory (it upcasts norm weights to float32) may remain, up to `MAX_IN_MEMORY_FRACTION` of the
  block: they stay in host memory, and count as host bytes;
- **a spill file**, otherwise (a pipeline built or changed in memory): the block's packed bytes are written
  once, atomically (temporary name, fsync, rename), to `<disk_dir>/<one folder per enable>/`, behind a small
  header with the byte count and a CRC-32 of the payload. Every read checks both, so a corrupt or truncated
  file is a `SpillFileError` naming it (raised by `wait_ready`, through the copy engine) and never a wrong
  picture. `restore_` and `rollback_` read the blocks back into real tensors and remove the folder.

Disk, link and compute run as three stages: a `StagingRing` (`runtime.staging`) of three host buffers (pinned
on an accelerator) is filled by a read-ahead I/O thread along the streamer's predictions (`follow_order_`: each
chain's declared order, then the order blocks actually run in) of disk blocks (two
blocks ahead), and a block's copy job only copies from the buffer already read into the slot (reading
synchronously only when the prediction missed: the first block, skipped blocks, an order the model changed). On
an accelerator the job runs on the compute thread (the engine issues copies from it), so the disk read must not
happen there; on the CPU the job runs on the engine's copy thread, and the read-ahead keeps the disk busy while
that thread copies host blocks.

The pooled blocks of alternating DiTs (`HostPoolChoice`: Wan 2.2's experts) are disk blocks too, with the same
sources, whose bytes stay in an entry of a `HostPool` (`runtime.host_pool`) while their DiT runs: a
`PooledBlock` copies from its entry, read from disk only when the other DiT ran since.

Disk-tier reads drop their pages from the page cache after them (and a spill file's pages go once written):
the memory the budget leaves free stays free, and every read reaches the disk. A simulated disk
(`simulated_gbps`, CPU measurements) keeps the page cache instead, so that the real disk is not what is timed;
it is one disk: the read-ahead and the pool's reads take turns on it.

`disk_stall_seconds` counts the time compute waited on the disk, apart from waits on the link: on an
accelerator the time the job (on the compute thread) waited for a read; on the CPU the part of compute's wait
for a disk block's slot during which its copy job was waiting for the read (`count_stall_`, called by the
streamer).

Spill folders are named after the process that wrote them (`enable-<pid space>-<pid>-<start time>-<random>`):
a process that died without `disable()` leaves its folder behind, and the next enable under the same
`disk_dir` removes the folders whose process no longer runs, never a live process's, nor one from another
machine or pid namespace sharing the folder (`remove_stale_spill_folders`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layerstream.errors import TransferError, UnsupportedUseError
from layerstream.plan.placement import HostPoolChoice
from layerstream.runtime.file_reads import FileRange, FileReader, MappedFiles, drop_cached_pages
from layerstream.runtime.host_pool import HostPool
from layerstream.runtime.layout import ALIGN_BYTES, BlockLayout, TensorBinder
from layerstream.runtime.protocols import Job, Pinner
from layerstream.runtime.staging import READ_AHEAD_DEPTH, StagingRing

logger = logging.getLogger(__name__)

SPILL_MAGIC = b"LSSPILL1"
_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32 of the payload
HEADER_BYTES = ALIGN_BYTES
"""The payload starts here: aligned, so that a read lands at the same residue as the slot."""
MAX_IN_MEMORY_FRACTION = 1 / 8
"""A file-backed block may keep this much of its bytes (spans made in memory) in host memory; beyond it the
whole block is spilled."""
SPILL_FOLDER_PREFIX = "enable-"
_SPILL_FOLDER = re.compile(r"^enable-(?P<space>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-")


class SpillFileError(TransferError):
    """A spill file of the disk tier is missing, truncated or corrupt (the message names the file)."""


class CheckpointChangedError(TransferError):
    """A checkpoint file the disk tier reads blocks from was replaced, truncated or removed since enable."""


def default_spill_root() -> Path:
    from layerstream.models.cache import cache_root  # the cache module reads the environment on every call

    return cache_root() / "spill"


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), 0 where /proc does not say, None if the
    process does not exist. With the pid it names one process: a pid reused by a later process starts later."""
    if os.name != "posix":
        return 0  # no signal 0 to probe with (on Windows os.kill would act on the process): count it as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # the command name (field 2) may hold spaces and parentheses: count fields after its closing parenthesis
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22, starttime


def process_space() -> str:
    """Where this process's pids mean something: its boot and pid namespace (8 hex digits). A `disk_dir` shared
    with other machines or containers holds folders whose pids cannot be checked from here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        import socket

        key = socket.gethostname()
    return f"{zlib.crc32(key.encode()):08x}"


def spill_folder_prefix() -> str:
    """The name this process's spill folders start with: its pid space, pid and start time."""
    pid = os.getpid()
    return f"{SPILL_FOLDER_PREFIX}{process_space()}-{pid}-{process_start_ticks(pid) or 0}-"


def remove_stale_spill_folders(root: Path) -> list[Path]:
    """Remove the spill folders under `root` whose process no longer runs (it died before `disable()`); a live
    process's folder, a folder from another machine or pid namespace (its pid cannot be checked here), and
    anything not named by this module are left alone. Returns the folders removed."""
    removed = []
    space = process_space()
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _SPILL_FOLDER.match(entry.name)
        if match is None or match["space"] != space or not entry.is_dir():
            continue
        started = process_start_ticks(int(match["pid"]))
        if started is not None and started in (0, int(match["start"])):
            continue  # alive (or alive without /proc to tell a reused pid apart): never touch it
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d spill folder(s) of processes that ended without disable(): %s", len(removed), removed)
    return removed


class _CheckpointSource:
    """A block backed by checkpoint file bytes: (file range, offset in the packed block) per span, and the few
    spans made in memory as (host bytes, offset). Each file's size and modification time are noted when the
    block is staged and checked before every read: a checkpoint replaced or truncated since is an error naming
    it, not another model's weights."""

    def __init__(self, ranges: list[tuple[FileRange, int]], in_memory: list[tuple[torch.Tensor, int]]):
        self.ranges = ranges
        self.in_memory = in_memory
        self.host_bytes = sum(t.numel() for t, _ in in_memory)
        self.stamps = {r.path: _stamp(r.path) for r, _ in ranges}

    def describe(self) -> str:
        return ", ".join(sorted({os.path.basename(r.path) for r, _ in self.ranges}))

    def read_into_(self, buffer: torch.Tensor, reader: FileReader) -> int:
        for path, stamp in self.stamps.items():
            try:
                now = _stamp(path)
            except OSError as e:
                raise CheckpointChangedError(f"checkpoint file {path} cannot be read: {e}") from e
            if now != stamp:
                raise CheckpointChangedError(
                    f"checkpoint file {path} changed since offload was enabled (size, modification time {now} "
                    f"instead of {stamp}); its blocks are read from it at every use: disable offload before "
                    "replacing the files"
                )
        for source, dst in self.ranges:
            reader.read_into_(buffer[dst : dst + source.nbytes], source)
        for chunk, dst in self.in_memory:
            buffer[dst : dst + chunk.numel()].copy_(chunk)
        return sum(r.nbytes for r, _ in self.ranges)


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


class _SpillSource:
    """A block's packed bytes in a spill file of ours, checked at every read."""

    host_bytes = 0

    def __init__(self, path: Path, nbytes: int):
        self.path = path
        self.nbytes = nbytes

    def describe(self) -> str:
        return str(self.path)

    @classmethod
    def write(cls, path: Path, payload: torch.Tensor) -> _SpillSource:
        """Write `payload` (uint8, contiguous, CPU) to `path` atomically: a reader sees no file or a whole one."""
        data = memoryview(payload.numpy())
        header = _HEADER.pack(SPILL_MAGIC, len(data), zlib.crc32(data)).ljust(HEADER_BYTES, b"\0")
        partial = path.with_name(path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, header)
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            os.fsync(fd)  # the bytes are on disk before the name says the file is complete
            drop_cached_pages(fd)  # written once, read from disk at every use: its pages need not stay cached
        finally:
            os.close(fd)
        os.replace(partial, path)
        return cls(path, len(data))

    def read_into_(self, buffer: torch.Tensor, reader: FileReader) -> int:
        """Fill `buffer[:nbytes]` with the payload, checked against the header; raises `SpillFileError`."""
        try:
            size = os.stat(self.path).st_size
            with open(self.path, "rb") as f:
                raw = f.read(_HEADER.size)
        except OSError as e:
            raise SpillFileError(f"spill file {self.path} cannot be read: {e}") from e
        if size != HEADER_BYTES + self.nbytes:
            raise SpillFileError(
                f"spill file {self.path} has {size} bytes, not the {HEADER_BYTES + self.nbytes} written (truncated "
                "or overwritten since offload was enabled)"
            )
        magic, nbytes, crc = _HEADER.unpack(raw)
        if magic != SPILL_MAGIC or nbytes != self.nbytes:
            raise SpillFileError(f"spill file {self.path}: the header is not the one written (overwritten since enable)")
        destination = buffer[: self.nbytes]
        try:
            reader.read_into_(destination, FileRange(str(self.path), HEADER_BYTES, self.nbytes))
        except OSError as e:
            raise SpillFileError(f"spill file {self.path} cannot be read: {e}") from e
        if zlib.crc32(memoryview(destination.numpy())) != crc:
            raise SpillFileError(f"spill file {self.path} is corrupt: its bytes do not match the checksum written")
        return self.nbytes


class DiskBlock:
    """One block of the disk tier: no host bytes; its copy job reads it from disk."""

    def __init__(
        self,
        store: DiskHostStore,
        layout: BlockLayout,
        binder: TensorBinder,
        source,
        original_device: torch.device,
        member: str | None = None,
    ):
        self.store = store
        self.member = member
        """The alternating DiT the block belongs to, where there is a host pool (None otherwise)."""
        self.layout = layout
        self.binder = binder
        self.source: _CheckpointSource | _SpillSource = source
        self.original_device = original_device
        self.disk_wait = (0.0, 0.0)
        """When the latest copy job waited for this block's bytes to come off the disk (perf_counter seconds)."""

    def __repr__(self) -> str:
        return f"DiskBlock({self.path!r}, {self.layout.nbytes} bytes from {self.source.describe()})"

    @property
    def path(self) -> str:
        return self.layout.path

    @property
    def host_bytes(self) -> int:
        return self.source.host_bytes  # at most the few spans made in memory (the staging ring is the store's)

    @property
    def pinned(self) -> bool:
        return False

    @property
    def link_bytes(self) -> int:
        return self.layout.nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        store = self.store
        on_compute_thread = slot_buffer.device.type != "cpu"  # accelerator engines run jobs where compute runs

        def job() -> int:
            if store.pool is not None and self.member is not None:
                store.pool.prepare_(self.member)  # the first block of another DiT: the pool reads its blocks
            nbytes = store.staging.copy_(self, slot_buffer, store.upcoming_after(self.path))
            self.disk_wait = store.staging.last_disk_wait
            if on_compute_thread:
                store.disk_stall_seconds += self.disk_wait[1] - self.disk_wait[0]  # compute itself waited
            return nbytes

        return job

    def count_stall_(self, stall_seconds: float) -> None:
        """Compute just waited `stall_seconds` for this block's copy (the CPU engine's copy thread ran the job):
        count the part of that wait during which the job was waiting for the disk."""
        started, ended = self.disk_wait
        now = time.perf_counter()
        overlap = min(ended, now) - max(started, now - stall_seconds)
        if overlap > 0:
            self.store.disk_stall_seconds += overlap

    def read_into_(self, buffer: torch.Tensor) -> None:
        """Fill `buffer` (uint8, CPU, `layout.nbytes`) with the block's packed bytes."""
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
    """A disk block whose bytes stay in an entry of the host pool while its DiT runs (`runtime.host_pool`)."""

    _where = "is read from disk into a host pool it shares with another DiT (host_budget_gb)"

    def __init__(self, *args, entry: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.entry = entry

    def __repr__(self) -> str:
        return f"PooledBlock({self.path!r}, pool entry {self.entry}, {self.layout.nbytes} bytes from {self.source.describe()})"

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        store = self.store
        on_compute_thread = slot_buffer.device.type != "cpu"

        def job() -> int:
            waited = time.perf_counter()
            entry = store.pool.take_(self)  # waits only when the pool is still reading it
            self.disk_wait = (waited, time.perf_counter())
            if on_compute_thread:
                store.disk_stall_seconds += self.disk_wait[1] - self.disk_wait[0]
            store.pool.copy_out_(entry, slot_buffer, self.layout.nbytes)
            return self.layout.nbytes

        return job


class DiskHostStore:
    """`HostStore` for the blocks the placement puts on disk (see the module docstring)."""

    kind = "disk"

    def __init__(
        self,
        disk_dir: str | os.PathLike | None = None,
        simulated_gbps: float | None = None,
        pool: HostPoolChoice | None = None,
    ):
        self.simulated_gbps = simulated_gbps
        """CPU measurements: every read lasts at least as long as on a disk of this bandwidth."""
        self.simulated_disk = threading.Lock()
        """Held through a simulated read: the read-ahead and the pool share one disk."""
        self.counting = threading.Lock()
        """Guards the byte count, which reads on several threads add to."""
        self.pool_choice = pool
        """The pool entries and members (None: no pool); `stage_` makes a `PooledBlock` of every pooled block."""
        self.pool: HostPool | None = None
        self.root = Path(disk_dir).expanduser() if disk_dir is not None else default_spill_root()
        self._successor: Callable[[str], str | None] | None = None
        """The streamer's prediction of the block that runs after a block (`follow_order_`): what the staging
        ring reads ahead along."""
        self._num_streamed = 0
        self.blocks: dict[str, DiskBlock] = {}
        self.disk_bytes_read = 0
        """Bytes read from disk (checkpoint files and spill files) since enable."""
        self.disk_stall_seconds = 0.0
        """Time compute waited for disk reads since enable (see the module docstring)."""
        self.spill_bytes_written = 0
        # a simulated disk stands for the disk: its reads may come from the page cache, the real disk is not timed
        self.reader = FileReader(drop_cached=simulated_gbps is None)
        self.folder: Path | None = None
        self._files: MappedFiles | None = None
        self._staging_nbytes = 0
        self.staging: StagingRing | None = None
        """Host buffers the disk blocks are read into (ahead) before their copy into the slot."""

    def __repr__(self) -> str:
        spilled = sum(isinstance(b.source, _SpillSource) for b in self.blocks.values())
        return f"DiskHostStore({len(self.blocks)} blocks, {spilled} spilled to {self.folder})"

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        """Read ahead along `successor` (the streamer's prediction of the block that runs after a block, learned
        from the order blocks run in) through all `num_blocks` streamed blocks, host blocks included, instead of
        each chain's declared order: the read-ahead follows a model that runs its blocks in another order, and
        reads the next component's first disk blocks where one component hands over to another."""
        self._successor = successor
        self._num_streamed = num_blocks

    def upcoming_after(self, path: str) -> list[DiskBlock]:
        """The staged disk blocks (not the pooled ones, which the pool reads) predicted to run after `path`, in
        order, up to `READ_AHEAD_DEPTH`; none before the streamer gave its predictions (nothing runs before)."""
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
        """Host bytes of the staging ring (beyond the budget)."""
        return sum(b.numel() for b in self.staging.buffers) if self.staging is not None else 0

    @property
    def pool_nbytes(self) -> int:
        """Host bytes of the pool (within the budget)."""
        return self.pool.nbytes if self.pool is not None else 0

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return layout.nbytes

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        self._staging_nbytes = slot_nbytes

    def report_failure_(self, error: BaseException) -> None:
        pass  # no peers to tell

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> DiskBlock:
        assert layout.path not in self.blocks, f"{layout.path} staged twice"
        if self._files is None:
            remove_stale_spill_folders(self.root)  # once per enable, before this enable writes anything
            self._files = MappedFiles.snapshot()
        if self.staging is None:
            self.staging = StagingRing(self._staging_nbytes, device, pin)
        choice = self.pool_choice
        entry = choice.entry_of(layout.path) if choice is not None else None
        if entry is not None and self.pool is None:
            self.pool = HostPool(choice.entry_nbytes, choice.member_blocks, device, pin)
        packed = None
        if entry is not None and self.pool.owner(entry) is None:  # the entry starts with this block's bytes
            packed = self.pool.buffers[entry][: layout.nbytes].zero_()  # zeroed pads: a spill file's bytes are defined
            layout.copy_sources_into(packed, self._files, self.reader)
        original_device = layout.source_device()
        spans = layout.span_file_ranges(self._files)
        in_memory = [(dst, length) for source, dst, length in spans if source is None and length > 0]
        if len(in_memory) < len(spans) and sum(n for _, n in in_memory) <= MAX_IN_MEMORY_FRACTION * layout.nbytes:
            chunks = []
            for dst, length in in_memory:
                chunk = torch.empty(length, dtype=torch.uint8)
                layout.copy_range_into(chunk, dst)
                chunks.append((chunk, dst))
            source = _CheckpointSource([(s, dst) for s, dst, _ in spans if s is not None], chunks)
        else:
            source = self._spill_(layout, packed)
        binder = TensorBinder(layout, device)
        member = choice.member_of(layout.path) if choice is not None else None
        if entry is not None:
            block = PooledBlock(self, layout, binder, source, original_device, member, entry=entry)
            self.pool.add_(block, holds_bytes=packed is not None)
        else:
            block = DiskBlock(self, layout, binder, source, original_device, member)
        block.binder.evict_()
        layout.forget_sources()  # the block's memory (or its view of the checkpoint) goes now
        self.blocks[layout.path] = block
        return block

    def _spill_(self, layout: BlockLayout, packed: torch.Tensor | None = None) -> _SpillSource:
        if self.folder is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # one folder per enable: processes (and pipelines) sharing disk_dir never touch each other's files;
            # named after this process, so that a later enable can tell whether it still runs
            self.folder = Path(tempfile.mkdtemp(prefix=spill_folder_prefix(), dir=self.root))
        buffer = packed
        if buffer is None:  # (the bytes already packed for a pool entry are written as they are)
            buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)  # zeroed pads: the file's bytes are all defined
            layout.copy_sources_into(buffer, self._files, self.reader)
        name = f"{len(self.blocks):05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', layout.path)}.block"
        source = _SpillSource.write(self.folder / name, buffer)
        self.spill_bytes_written += layout.nbytes
        return source

    def commit_(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None

    def rollback_(self) -> None:
        self.commit_()
        self._close_staging_()
        try:
            self._restore_blocks_(lambda block: block.original_device)
        finally:
            self._release_()

    def restore_(self, device: torch.device) -> None:
        self._close_staging_()  # first: a read-ahead (or pool read) in flight uses the reader the restore reads with
        try:
            self._restore_blocks_(lambda block: device)
        finally:
            self._release_()

    def _close_staging_(self) -> None:
        """Stop reading ahead and free the staging ring and the pool."""
        try:
            if self.staging is not None:
                self.staging.close_()
                self.staging = None
        finally:
            if self.pool is not None:
                self.pool.close_()
                self.pool = None

    def _restore_blocks_(self, device_of) -> None:
        """Every block gets real tensors again, read (and checked) from disk; the first failure is raised after
        every other block is restored."""
        first_error: BaseException | None = None
        for path in list(self.blocks):
            block = self.blocks.pop(path)
            buffer = torch.empty(block.layout.nbytes, dtype=torch.uint8)
            try:
                block.read_into_(buffer)
            except (OSError, TransferError) as e:
                logger.error("%s: cannot be read back from disk: %s", path, e)
                first_error = first_error or e
                continue
            block.binder.bind_(block.layout.separate_copies(buffer, device_of(block)))
        if first_error is not None:
            raise first_error

    def _release_(self) -> None:
        """Stop reading, free the staging ring and remove the spill files (the engine is closed: nothing reads)."""
        self._close_staging_()
        self.reader.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
