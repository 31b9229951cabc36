"""Memory cgroups for tests that run a child process under a real memory limit (cgroup v1, as root).

`memory_cgroup` makes a new cgroup under this process's own (so that its limits still hold) and removes it
afterwards; tests where Linux, root and a writable cgroup v1 memory controller are not all there are skipped
with the reason. A child joins by writing its pid (or "0", itself) into the cgroup's `cgroup.procs`.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
OOM_KILLED = -9
"""A child's return code when the cgroup's OOM killer ended it (SIGKILL)."""


def own_memory_cgroup() -> Path | None:
    """The folder of this process's memory cgroup (new cgroups go under it, so that its limits still hold)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = MEMORY_ROOT / path.lstrip("/")
            return folder if folder.is_dir() else MEMORY_ROOT
    return None


def why_no_memory_cgroup() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux memory cgroups"
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    if not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {MEMORY_ROOT}"
    parent = own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        return f"the memory cgroup of this process ({parent}) is not writable"
    return None


@pytest.fixture
def make_memory_cgroup():
    """Make as many cgroups as a test needs (`make()` -> folder), each removed afterwards."""
    why = why_no_memory_cgroup()
    if why is not None:
        pytest.skip(why)
    made: list[Path] = []

    def make() -> Path:
        folder = own_memory_cgroup() / f"layerstream-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()
        except OSError as e:
            pytest.skip(f"cannot create a memory cgroup: {e}")
        made.append(folder)
        return folder

    yield make
    for folder in made:
        folder.rmdir()  # an empty cgroup (its children have exited) is removed with rmdir


@pytest.fixture
def memory_cgroup(make_memory_cgroup):
    """One new memory cgroup under this process's own; removed afterwards (its processes have ended by then)."""
    return make_memory_cgroup()
