"""How much host memory this process may still take: the smaller of `MemAvailable` and, for the process's memory
cgroup and each one above it (a container's, a Slurm job's: crossing it kills the process without a word), its
limit minus its working set: usage less the file cache the kernel drops before it kills anything (not mapped,
not dirty). The headroom errs low, never high, but for the pages under the views enabling packs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from layerstream.procfs import mem_available_nbytes
from layerstream.wording import format_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
UNLIMITED_NBYTES = 2**62  # a cgroup v1 limit at or above this is "no limit" (the kernel shows a page-rounded LONG_MAX)


@dataclass(frozen=True)
class CgroupLimit:
    """One memory cgroup that limits this process (bytes)."""

    version: int
    folder: str
    limit_nbytes: int
    usage_nbytes: int
    inactive_file_nbytes: int = 0  # what `docker stats` leaves out of the working set, shown beside ours
    reclaimable_nbytes: int = 0  # page cache the kernel can drop: the file cache less mapped and dirty pages
    mapped_file_nbytes: int = 0
    released_mapped_nbytes: int = 0  # mapped pages that enabling unmaps, and so reclaimable too

    @property
    def working_set_nbytes(self) -> int:
        return max(self.usage_nbytes - self.reclaimable_nbytes - self.released_mapped_nbytes, 0)

    @property
    def headroom_nbytes(self) -> int:
        return max(self.limit_nbytes - self.working_set_nbytes, 0)

    def describe(self) -> str:
        return (
            f"cgroup v{self.version} {self.folder}: limit {format_bytes(self.limit_nbytes)} - working set "
            f"{format_bytes(self.working_set_nbytes)} (usage {format_bytes(self.usage_nbytes)} - reclaimable page cache "
            f"{format_bytes(self.usage_nbytes - self.working_set_nbytes)}{self._released()}, inactive file "
            f"{format_bytes(self.inactive_file_nbytes)})"
        )

    def _released(self) -> str:
        if not self.released_mapped_nbytes:
            return ""
        return f" with {format_bytes(self.released_mapped_nbytes)} mapped under the streamed blocks' views"

    def to_dict(self) -> dict[str, int | str]:
        return {
            "version": self.version, "folder": self.folder, "limit_bytes": self.limit_nbytes,
            "usage_bytes": self.usage_nbytes, "inactive_file_bytes": self.inactive_file_nbytes,
            "reclaimable_bytes": self.usage_nbytes - self.working_set_nbytes,
            "mapped_file_bytes": self.mapped_file_nbytes, "released_mapped_bytes": self.released_mapped_nbytes,
            "working_set_bytes": self.working_set_nbytes, "headroom_bytes": self.headroom_nbytes,
        }  # fmt: skip


@dataclass(frozen=True)
class HostMemory:
    """What was read: `MemAvailable` (None where there is no /proc/meminfo) and the binding cgroup (if any)."""

    available_nbytes: int | None
    cgroup: CgroupLimit | None = None

    @property
    def free_nbytes(self) -> int | None:
        """The smaller of the available memory and the cgroup's headroom; None where neither could be read."""
        figures = [n for n in (self.available_nbytes, self.cgroup and self.cgroup.headroom_nbytes) if n is not None]
        return min(figures) if figures else None

    def releasing_mapped(self, nbytes: int) -> HostMemory:
        """These figures with `nbytes` of mapped file pages under the views enabling packs counted as reclaimable
        in the cgroup (at most its mapped pages). A warm cgroup maps more of a cached checkpoint than a cold one
        (14 MB at enable cold, 15-31 MB warm), which alone moved the budget by up to 6%."""
        if self.cgroup is None or nbytes <= 0:
            return self
        released = min(nbytes, self.cgroup.mapped_file_nbytes)
        return dataclasses.replace(self, cgroup=dataclasses.replace(self.cgroup, released_mapped_nbytes=released))

    def describe(self) -> str:
        parts = []
        if self.available_nbytes is not None:
            parts.append(f"MemAvailable {format_bytes(self.available_nbytes)}")
        if self.cgroup is not None:
            parts.append(self.cgroup.describe())
        return "; ".join(parts) if parts else "nothing readable"

    def to_dict(self) -> dict[str, object]:
        return {
            "free_bytes": self.free_nbytes,
            "available_bytes": self.available_nbytes,
            "cgroup": self.cgroup.to_dict() if self.cgroup is not None else None,
        }


def read_host_memory(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> HostMemory:
    """The host memory figures of this process (the roots are parameters so that tests can fake them)."""
    return HostMemory(mem_available_nbytes(proc), _binding_cgroup(proc / "self" / "cgroup", cgroup_root))


def _binding_cgroup(self_cgroup: Path, root: Path) -> CgroupLimit | None:
    """The cgroup with the least headroom among this process's memory cgroups and their ancestors."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[CgroupLimit] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2 (the unified hierarchy: alone, or beside v1 in hybrid mode)
            for mount in (root, root / "unified"):
                limits += _levels(mount, path, _V2)
        elif "memory" in controllers.split(","):
            limits += _levels(root / "memory", path, _V1)
    return min(limits, key=lambda c: c.headroom_nbytes, default=None)


@dataclass(frozen=True)
class _Files:
    version: int
    limit: str
    usage: str
    stat_keys: tuple[str, str, str, str]  # inactive and active file cache, mapped and dirty pages


_V1 = _Files(1, "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file", "total_mapped_file", "total_dirty"))
_V2 = _Files(2, "memory.max", "memory.current", ("inactive_file", "active_file", "file_mapped", "file_dirty"))


def _levels(mount: Path, path: str, files: _Files) -> list[CgroupLimit]:
    """Every level from the process's cgroup up to the mount that has a limit."""
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount  # a cgroup namespace: the process's own cgroup is the root of what it sees
    out = []
    while True:
        limit, usage = _read_int(folder / files.limit), _read_int(folder / files.usage)
        if limit is not None and usage is not None and limit < UNLIMITED_NBYTES:
            inactive, active, mapped, dirty = _read_stat(folder / "memory.stat", files.stat_keys)
            # the kernel drops unmapped clean file cache whichever list it is on (a run that read its checkpoint
            # twice leaves it active: 49 of a finished run's 110 MB). Docker's `inactive_file` alone also holds
            # mapped pages, on a cold cgroup's inactive list and a warm one's active list: a warm budget 5-6% lower
            unused = max(inactive + active - mapped - dirty, 0)
            out.append(CgroupLimit(files.version, str(folder), limit, usage, min(inactive, usage), min(unused, usage), mapped))
        if folder == mount or mount not in folder.parents:
            return out
        folder = folder.parent


def _read_stat(file: Path, keys: tuple[str, ...]) -> tuple[int, ...]:
    """Figures of a cgroup's `memory.stat` ("key value" lines); 0 for one absent, or all where the file is."""
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return tuple(0 for _ in keys)
    stat = dict(line.partition(" ")[::2] for line in lines)
    return tuple(int(stat[k]) if stat.get(k, "").strip().isdigit() else 0 for k in keys)


def _read_int(file: Path) -> int | None:
    """A number in a cgroup file; None where it is absent, unreadable or "max" (no limit)."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
