"""Reading file-backed weights straight from their files: copying out of safetensors' private mapping faults the
file in page by page (a few hundred MB/s) and keeps every touched page counted in the process; large `preadv`
calls on a few threads run at the disk's speed. `MappedFiles` tells which file backs an address range, from
/proc (a page written since it was mapped is anonymous memory: that range is copied from memory).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
READ_CHUNK_BYTES = 16 * 2**20  # per `preadv`: enough for the disk's full speed, small enough to spread over threads
NUM_READ_THREADS = 4


@dataclass(frozen=True)
class FileRange:
    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    offset: int
    path: str


class MappedFiles:
    """The process's private file mappings, read once (call `snapshot` again after new files are mapped)."""

    def __init__(self, mappings: list[_Mapping]):
        self._mappings = sorted(mappings, key=lambda m: m.start)
        self._pagemap: int | None = None

    @classmethod
    def snapshot(cls) -> MappedFiles:
        try:
            with open("/proc/self/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            return cls([])
        mappings = []
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[1].endswith("p") or not parts[5].startswith("/"):
                continue  # shared mappings could change under us; anonymous ones have no file
            path = parts[5]
            if path.endswith(" (deleted)") or not os.path.isfile(path):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            mappings.append(_Mapping(start, end, int(parts[2], 16), path))
        return cls(mappings)

    def __len__(self) -> int:
        return len(self._mappings)

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in one file mapping (written pages or not)."""
        return self._mapping_of(address, nbytes) is not None

    def file_range(self, address: int, nbytes: int) -> FileRange | None:
        """The file bytes that back [address, address + nbytes), if one private file mapping covers the whole
        range and none of its pages was written since it was mapped; else None."""
        mapping = self._mapping_of(address, nbytes)
        if mapping is None or not self._pages_hold_file_bytes(address, nbytes):
            return None
        return FileRange(mapping.path, mapping.offset + address - mapping.start, nbytes)

    def close(self) -> None:
        if self._pagemap is not None:
            os.close(self._pagemap)
            self._pagemap = None

    def _mapping_of(self, address: int, nbytes: int) -> _Mapping | None:
        """The mapping that holds the whole of [address, address + nbytes), if any."""
        lo, hi = 0, len(self._mappings)
        while lo < hi:  # the last mapping starting at or before the address
            mid = (lo + hi) // 2
            if self._mappings[mid].start <= address:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0 or nbytes <= 0:
            return None
        mapping = self._mappings[lo - 1]
        return mapping if address + nbytes <= mapping.end else None

    def present_file_nbytes(self, address: int, nbytes: int) -> int:
        """Bytes of the pages of [address, address + nbytes) in memory and still the file's own (clean page cache
        mapped here, which the kernel can reclaim); 0 outside a file mapping or without pagemap."""
        entries = self._pagemap_entries(address, nbytes) if self._mapping_of(address, nbytes) else None
        if entries is None:
            return 0
        return int(((entries < 0) & (((entries >> 61) & 1) == 1)).sum()) * PAGE_BYTES

    def _pagemap_entries(self, address: int, nbytes: int) -> torch.Tensor | None:
        """One pagemap entry per page of the range (int64: bit 63 present, 62 swapped, 61 file page)."""
        if self._pagemap is None:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
            except OSError:
                return None
        first, last = address // PAGE_BYTES, (address + nbytes - 1) // PAGE_BYTES
        count = last - first + 1
        try:
            raw = os.pread(self._pagemap, 8 * count, 8 * first)
        except OSError:
            return None
        if len(raw) != 8 * count:
            return None
        return torch.frombuffer(bytearray(raw), dtype=torch.int64)

    def _pages_hold_file_bytes(self, address: int, nbytes: int) -> bool:
        """Every page is either not yet faulted in (so it reads from the file) or a page of the file itself."""
        entries = self._pagemap_entries(address, nbytes)
        if entries is None:
            return False
        # one vectorized pass (a 60 GB model has millions of pages): bit 63 present, 62 swapped, 61 file page
        if bool(((entries >> 62) & 1).any()):
            return False  # only anonymous (written) pages of a private mapping go to swap
        if bool(((entries < 0) & (((entries >> 61) & 1) == 0)).any()):
            return False  # present but not a page of the file: copied on write, memory differs from the file
        return True


class FileReader:
    """Reads file ranges into host tensors with large `preadv` calls on a few threads. `drop_cached` (the disk
    tier) drops each range from the page cache: the memory the budget keeps free stays free."""

    def __init__(self, num_threads: int = NUM_READ_THREADS, drop_cached: bool = False):
        self.drop_cached = drop_cached and hasattr(os, "posix_fadvise")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="layerstream-read")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read_into_(self, destination: torch.Tensor, source: FileRange) -> None:
        self.read_all_([(destination, source)])

    def read_all_(self, reads: list[tuple[torch.Tensor, FileRange]]) -> None:
        """Fill every destination (contiguous uint8) with its file range, all chunks of all reads in flight at
        once (a block is many tensors of a few MB: read one after the other, most threads would idle)."""
        self.start_reads_(reads)()

    def start_reads_(self, reads: list[tuple[torch.Tensor, FileRange]]):
        """Start `read_all_`'s reads; return a function that waits for them and raises the first failure."""
        jobs = []
        try:
            for destination, source in reads:
                assert destination.dtype == torch.uint8 and destination.is_contiguous() and destination.numel() == source.nbytes
                fd = self._open(source.path)  # raises for a file that is gone
                base = destination.data_ptr()
                for start in range(0, source.nbytes, READ_CHUNK_BYTES):
                    length = min(READ_CHUNK_BYTES, source.nbytes - start)
                    jobs.append(
                        self._pool.submit(_pread_exactly, fd, base + start, length, source.offset + start, source.path, self.drop_cached)
                    )
        except BaseException:
            for job in jobs:  # the caller frees its buffers when this raises: no read may still write into them
                job.exception()
            raise

        def wait() -> None:
            error = None
            for job in jobs:  # wait for every job (none may still write into a buffer after we return), then raise
                try:
                    job.result()
                except OSError as e:  # a truncated file names itself
                    error = error or e
            if error is not None:
                raise error

        return wait

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _open(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd


def _pread_exactly(fd: int, address: int, length: int, offset: int, path: str, drop_cached: bool = False) -> None:
    view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: the file ends at byte {offset + done}, before the {length} bytes expected from {offset}")
        done += n
    if drop_cached:
        drop_cached_pages(fd, offset, length)


def drop_cached_pages(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop a file range's clean cached pages (`length` 0: the whole file); only a hint."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            logger.debug("posix_fadvise(DONTNEED) failed", exc_info=True)
