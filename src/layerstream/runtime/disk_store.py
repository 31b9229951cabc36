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

Disk, link and compute run as three stages: a `StagingRing` of three host buffers (pinned on an accelerator)
is filled by a read-ahead I/O thread along each chain's declared order of disk blocks (two blocks ahead), and
a block's copy job only copies from the buffer already read into the slot (reading synchronously only when the
prediction missed: the first block, skipped blocks, an order the model changed). On an accelerator the job runs on the compute thread
(the engine issues copies from it), so the disk read must not happen there; on the CPU the job runs on the
engine's copy thread, and the read-ahead keeps the disk busy while that thread copies host blocks.

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
import time
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from layerstream.errors import TransferError, UnsupportedUseError
from layerstream.runtime.file_reads import FileRange, FileReader, MappedFiles
from layerstream.runtime.layout import ALIGN_BYTES, BlockLayout, TensorBinder
from layerstream.runtime.protocols import Job, Pinner

logger = logging.getLogger(__name__)

SPILL_MAGIC = b"LSSPILL1"
_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32 of the payload
HEADER_BYTES = ALIGN_BYTES
"""The payload starts here: aligned, so that a read lands at the same residue as the slot."""
MAX_IN_MEMORY_FRACTION = 1 / 8
"""A file-backed block may keep this much of its bytes (spans made in memory) in host memory; beyond it the
whole block is spilled."""
READ_AHEAD_DEPTH = 2
"""Disk blocks read ahead of the one being copied: the disk goes on to the next block without waiting for the
copy side to ask for it (one block ahead, the disk idles whenever the copy side is late to ask)."""
NUM_STAGING_BUFFERS = READ_AHEAD_DEPTH + 1
"""The buffers the read-ahead fills, and the one the latest copy comes from."""
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

    def __init__(self, store: DiskHostStore, layout: BlockLayout, binder: TensorBinder, source, original_device: torch.device):
        self.store = store
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
        start = time.perf_counter()
        nbytes = self.source.read_into_(buffer, self.store.reader)
        self.store.disk_bytes_read += nbytes
        gbps = self.store.simulated_gbps
        if gbps is not None:
            remaining = nbytes / (gbps * 1e9) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)  # the simulated disk: the read lasts as long as it would on that disk

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        self._refuse("backward through it")

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        self._refuse("keep what its forward wrote into its buffers")

    def host_tensors(self) -> list[torch.Tensor]:
        self._refuse("read or write its weights in place (state_dict, load_state_dict, LoRA)")

    def _refuse(self, what: str):
        raise UnsupportedUseError(
            f"{self.path}: the block lives on disk (host_budget_gb), not in host memory; cannot {what}. Raise "
            "host_budget_gb so that it fits in host memory, or call handle.disable() first"
        )


class DiskHostStore:
    """`HostStore` for the blocks the placement puts on disk (see the module docstring)."""

    kind = "disk"

    def __init__(
        self,
        disk_dir: str | os.PathLike | None = None,
        read_ahead: Mapping[str, str] | None = None,
        simulated_gbps: float | None = None,
    ):
        self.simulated_gbps = simulated_gbps
        """CPU measurements: every read lasts at least as long as on a disk of this bandwidth."""
        self.root = Path(disk_dir).expanduser() if disk_dir is not None else default_spill_root()
        self.read_ahead: Mapping[str, str] = read_ahead or {}
        """Disk block -> the disk block its chain runs next (what the staging ring reads ahead)."""
        self.blocks: dict[str, DiskBlock] = {}
        self.disk_bytes_read = 0
        """Bytes read from disk (checkpoint files and spill files) since enable."""
        self.disk_stall_seconds = 0.0
        """Time compute waited for disk reads since enable (see the module docstring)."""
        self.spill_bytes_written = 0
        self.reader = FileReader()
        self.folder: Path | None = None
        self._files: MappedFiles | None = None
        self._staging_nbytes = 0
        self.staging: StagingRing | None = None
        """Host buffers the disk blocks are read into (ahead) before their copy into the slot."""

    def __repr__(self) -> str:
        spilled = sum(isinstance(b.source, _SpillSource) for b in self.blocks.values())
        return f"DiskHostStore({len(self.blocks)} blocks, {spilled} spilled to {self.folder})"

    def upcoming_after(self, path: str) -> list[DiskBlock]:
        """The disk blocks expected after `path`, in order (its chain's, cyclic), up to `READ_AHEAD_DEPTH`."""
        upcoming: list[DiskBlock] = []
        current = path
        for _ in range(READ_AHEAD_DEPTH):
            current = self.read_ahead.get(current, "")
            block = self.blocks.get(current)
            if block is None or current == path:
                break
            upcoming.append(block)
        return upcoming

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
            source = self._spill_(layout)
        block = DiskBlock(self, layout, TensorBinder(layout, device), source, original_device)
        block.binder.evict_()
        layout.forget_sources()  # the block's memory (or its view of the checkpoint) goes now
        self.blocks[layout.path] = block
        return block

    def _spill_(self, layout: BlockLayout) -> _SpillSource:
        if self.folder is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # one folder per enable: processes (and pipelines) sharing disk_dir never touch each other's files;
            # named after this process, so that a later enable can tell whether it still runs
            self.folder = Path(tempfile.mkdtemp(prefix=spill_folder_prefix(), dir=self.root))
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
        self._close_staging_()  # first: a read-ahead in flight uses the reader the restore reads with
        try:
            self._restore_blocks_(lambda block: device)
        finally:
            self._release_()

    def _close_staging_(self) -> None:
        if self.staging is not None:
            self.staging.close_()
            self.staging = None

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


class StagingRing:
    """`READ_AHEAD_DEPTH + 1` host buffers (pinned where the engine can pin) that disk blocks are read into, then
    copied to the slot (asynchronously from pinned memory on an accelerator), with a read-ahead on an I/O thread.

    A job for block B takes B's bytes from the buffer the read-ahead filled (when it predicted B; else it reads
    B there and then, synchronously), makes sure the next `READ_AHEAD_DEPTH` disk blocks of B's chain
    (`HostTierChoice.next_on_disk`) are being read into the other buffers, then copies B into the slot. The I/O
    thread reads them one after another, so the disk never waits for the copy side to ask for the next block:
    while the blocks between two disk blocks compute (and cross the link), the disk reads the next ones. Disk,
    link and compute run as three stages."""

    def __init__(self, nbytes: int, device: torch.device, pin: Pinner | None):
        self.buffers = [torch.empty(max(nbytes, 1), dtype=torch.uint8) for _ in range(NUM_STAGING_BUFFERS)]
        self._pinner: Pinner | None = None
        if pin is not None:
            pinned = [b for b in self.buffers if pin.pin_(b)]
            if len(pinned) == len(self.buffers):
                self._pinner = pin
            else:  # all or none: the copies below are asynchronous only from pinned memory
                for b in pinned:
                    pin.unpin_(b)
        # one event per buffer, re-recorded for every copy (a never-recorded event counts as complete); without
        # CUDA events (or pinned memory) the copies are synchronous and need none
        cuda = device.type == "cuda" and self._pinner is not None
        self._copied = [torch.cuda.Event() if cuda else None for _ in self.buffers]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-disk-ahead")
        self._ahead: deque[tuple[str, int, Future]] = deque()
        """Reads issued ahead, in the order their blocks are expected: (block path, buffer, read)."""
        self._last = 0  # the buffer the latest copy came from
        self.num_read_ahead_hits = 0
        self.num_read_ahead_misses = 0
        self.last_disk_wait = (0.0, 0.0)
        """When the latest `copy_` waited for its block's bytes to come off the disk (perf_counter seconds)."""

    def copy_(self, block: DiskBlock, slot_buffer: torch.Tensor, upcoming: Sequence[DiskBlock] = ()) -> int:
        """Fill `slot_buffer[:nbytes]` with `block`'s bytes (checked) through a staging buffer, having made sure
        that the blocks expected next (`upcoming`, the first `READ_AHEAD_DEPTH` of them) are being read ahead.
        Runs on the thread of the copy job, on its stream."""
        nbytes = block.layout.nbytes
        waited = time.perf_counter()
        i = self._take_(block)
        self.last_disk_wait = (waited, time.perf_counter())
        self._last = i
        self._read_ahead_(block, upcoming, i)  # first: the disk reads the next blocks while this one is copied
        staging = self.buffers[i][:nbytes]
        copied = self._copied[i]
        if copied is None:
            slot_buffer[:nbytes].copy_(staging)  # no event to tell when an asynchronous copy is done: in step
        else:
            slot_buffer[:nbytes].copy_(staging, non_blocking=True)
            copied.record()  # on the current stream: the engine's copy stream while the job runs
        return nbytes

    def _take_(self, block: DiskBlock) -> int:
        """The buffer holding `block`'s bytes: the read-ahead's when it read this block, else read now."""
        position = next((k for k, (path, _, _) in enumerate(self._ahead) if path == block.path), None)
        if self._ahead:
            if position == 0:
                self.num_read_ahead_hits += 1
            else:
                self.num_read_ahead_misses += 1  # another order than the chain's (a skipped block, a new chain)
        if position is not None:
            self._drop_ahead_(position)  # the reads of blocks that were skipped
            _, i, future = self._ahead.popleft()
            future.result()  # compute waits here only if the disk has not finished yet; a bad file raises
            return i
        self._drop_ahead_(len(self._ahead))
        free = self._free_buffer_(busy=())
        self._wait_copied_(free)
        block.read_into_(self.buffers[free][: block.layout.nbytes])  # checked before any byte reaches the slot
        return free

    def _read_ahead_(self, block: DiskBlock, upcoming: Sequence[DiskBlock], current: int) -> None:
        """Keep reads in flight for the next disk blocks: the ones already issued in the expected order stay, the
        others are dropped, the missing ones are issued into free buffers."""
        wanted = [b for b in upcoming if b is not block][:READ_AHEAD_DEPTH]
        kept = 0
        while kept < min(len(self._ahead), len(wanted)) and self._ahead[kept][0] == wanted[kept].path:
            kept += 1
        while len(self._ahead) > kept:
            self._forget_(self._ahead.pop())
        for next_block in wanted[kept:]:
            i = self._free_buffer_(busy=(current,))

            def read(i: int = i, next_block: DiskBlock = next_block) -> None:
                self._wait_copied_(i)
                next_block.read_into_(self.buffers[i][: next_block.layout.nbytes])

            self._ahead.append((next_block.path, i, self._io.submit(read)))

    def _drop_ahead_(self, count: int) -> None:
        for _ in range(count):
            self._forget_(self._ahead.popleft())

    @staticmethod
    def _forget_(entry: tuple[str, int, Future]) -> None:
        path, _, future = entry
        try:
            future.result()  # a read that is not needed still owns its buffer until it ends
        except (OSError, TransferError):
            logger.debug("read-ahead of %s failed; it is read again when it runs", path, exc_info=True)

    def _free_buffer_(self, busy: tuple[int, ...]) -> int:
        """A buffer no read ahead owns and not in `busy`; the one the latest copy came from last (on an
        accelerator its copy may still be in flight)."""
        taken = {i for _, i, _ in self._ahead} | set(busy)
        free = [i for i in range(len(self.buffers)) if i not in taken]
        assert free, "staging ring: more reads ahead than buffers"
        others = [i for i in free if i != self._last]
        return others[0] if others else free[0]

    def _wait_copied_(self, i: int) -> None:
        copied = self._copied[i]
        if copied is not None:
            # host-side wait (on the I/O thread for a read-ahead): the device copy out of this buffer must finish
            # before a disk read overwrites it; it was issued a block ago, so it has usually finished
            copied.synchronize()

    def close_(self) -> None:
        """Wait for the read-ahead, then free the buffers (the engine is closed: no device copy reads them)."""
        self._io.shutdown(wait=True)
        self._ahead.clear()
        if self._pinner is not None:
            for b in self.buffers:
                self._pinner.unpin_(b)
            self._pinner = None
        self.buffers, self._copied = [], []
