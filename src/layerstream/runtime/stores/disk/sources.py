"""Where a disk-tier block's bytes come from: the checkpoint's own files, or a spill file written atomically
behind a checked header and CRC-32 (a corrupt file is an error naming it, never a wrong picture); spill folders
are named after their process, so that a later enable removes a dead process's.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

import torch

from layerstream.errors import TransferError
from layerstream.processes import OWNER_TAG, owner_has_ended, owner_tag
from layerstream.runtime.packing.file_reads import FileRange, FileReader, drop_cached_pages
from layerstream.runtime.packing.layout import ALIGN_BYTES

logger = logging.getLogger(__name__)

SPILL_MAGIC = b"LSSPILL1"
_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32 of the payload
HEADER_BYTES = ALIGN_BYTES  # the payload starts here: aligned, so that a read lands at the same residue as the slot
SPILL_FOLDER_PREFIX = "enable-"
_SPILL_FOLDER = re.compile(rf"^{SPILL_FOLDER_PREFIX}(?P<owner>{OWNER_TAG})-")


class SpillFileError(TransferError):
    """A spill file of the disk tier is missing, truncated or corrupt (the message names the file)."""


class CheckpointChangedError(TransferError):
    """A checkpoint file the disk tier reads blocks from was replaced, truncated or removed since enable."""


def spill_folder_prefix() -> str:
    """The name this process's spill folders start with: its pid space, pid and start time (`owner_tag`)."""
    return f"{SPILL_FOLDER_PREFIX}{owner_tag()}-"


def remove_stale_spill_folders(root: Path) -> list[Path]:
    """Remove (and return) the spill folders under `root` whose process surely no longer runs."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _SPILL_FOLDER.match(entry.name)
        if match is None or not entry.is_dir() or not owner_has_ended(match["owner"]):
            continue  # alive, or where this process cannot tell: never touch it
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d spill folder(s) of processes that ended without disable(): %s", len(removed), removed)
    return removed


class CheckpointSource:
    """A block backed by checkpoint file ranges; each file's size and modification time are checked before every
    read (a checkpoint replaced since is an error naming it, not another model's weights)."""

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


class SpillSource:
    """A block's packed bytes in a spill file of ours, checked at every read."""

    host_bytes = 0

    def __init__(self, path: Path, nbytes: int):
        self.path = path
        self.nbytes = nbytes

    def describe(self) -> str:
        return str(self.path)

    @classmethod
    def write(cls, path: Path, payload: torch.Tensor) -> SpillSource:
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
