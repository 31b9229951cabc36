"""How much host memory this process may still take: `MemAvailable`, and the memory cgroup's headroom.

A container, a Slurm job or a systemd unit puts the process in a memory cgroup whose limit is often far below
the machine's memory, and crossing it gets the process killed without a word. So the free memory is the
smaller of `MemAvailable` in /proc/meminfo and, for the process's own cgroup and each cgroup above it, its
limit minus its usage: cgroup v2 `memory.max` - `memory.current`, cgroup v1 `memory.limit_in_bytes` -
`memory.usage_in_bytes` (the folder named by /proc/self/cgroup under the mount; a container that shows its
own cgroup as the root of the mount is read there). Usage includes page cache the kernel could reclaim, so
the headroom errs low, never high.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
UNLIMITED_NBYTES = 2**62
"""A cgroup v1 limit at or above this is "no limit" (the kernel shows a page-rounded LONG_MAX)."""


@dataclass(frozen=True)
class CgroupLimit:
    """One memory cgroup that limits this process: where it is, its limit and its usage (bytes)."""

    version: int
    folder: str
    limit_nbytes: int
    usage_nbytes: int

    @property
    def headroom_nbytes(self) -> int:
        return max(self.limit_nbytes - self.usage_nbytes, 0)


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

    def describe(self) -> str:
        parts = []
        if self.available_nbytes is not None:
            parts.append(f"MemAvailable {self.available_nbytes / 1e9:.3g} GB")
        if self.cgroup is not None:
            c = self.cgroup
            parts.append(
                f"cgroup v{c.version} {c.folder}: limit {c.limit_nbytes / 1e9:.3g} GB - usage {c.usage_nbytes / 1e9:.3g} GB"
            )
        return "; ".join(parts) if parts else "nothing readable"


def read_host_memory(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> HostMemory:
    """The host memory figures of this process (the roots are parameters so that tests can fake them)."""
    return HostMemory(_mem_available(proc / "meminfo"), _binding_cgroup(proc / "self" / "cgroup", cgroup_root))


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            value, *unit = rest.split()
            return int(value) * (1024 if unit == ["kB"] else 1)
    return None


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
                limits += _levels(mount, path, "memory.max", "memory.current", version=2)
        elif "memory" in controllers.split(","):
            limits += _levels(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes", version=1)
    return min(limits, key=lambda c: c.headroom_nbytes, default=None)


def _levels(mount: Path, path: str, limit_file: str, usage_file: str, *, version: int) -> list[CgroupLimit]:
    """Every level from the process's cgroup up to the mount that has a limit."""
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount  # a cgroup namespace: the process's own cgroup is the root of what it sees
    out = []
    while True:
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < UNLIMITED_NBYTES:
            out.append(CgroupLimit(version, str(folder), limit, usage))
        if folder == mount or mount not in folder.parents:
            return out
        folder = folder.parent


def _read_int(file: Path) -> int | None:
    """A number in a cgroup file; None where it is absent, unreadable or "max" (no limit)."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
