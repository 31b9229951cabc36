"""Memory figures the Linux kernel shows in /proc: host memory available (``MemAvailable`` of /proc/meminfo) and
this process's peak resident set (``VmHWM`` of /proc/self/status). Elsewhere (no /proc) every figure is None."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def proc_nbytes(path: Path, key: str) -> int | None:
    """Figure `key` of a /proc file of ``Key:  value kB`` lines, in bytes; None if the file or the key is missing."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == key:
            value, *unit = rest.split()
            return int(value) * (1024 if unit == ["kB"] else 1)  # the kernel writes kB (a few counts have no unit)
    return None


def mem_available_nbytes(proc: Path = PROC) -> int | None:
    """Host memory available to new allocations without swapping (``MemAvailable``)."""
    return proc_nbytes(proc / "meminfo", "MemAvailable")


def peak_rss_nbytes(proc: Path = PROC) -> int | None:
    """This process's peak resident set so far (``VmHWM``)."""
    return proc_nbytes(proc / "self" / "status", "VmHWM")
