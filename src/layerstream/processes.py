"""Naming a process so that a later look can tell whether it still runs (`owner_tag`, `owner_has_ended`). A pid
alone does not do, as pids are reused: the start time from /proc tells a reused pid apart, and the boot and pid
namespace whether a pid can be checked from here at all (a shared folder holds other machines' tags)."""

from __future__ import annotations

import os
import re
import zlib

OWNER_TAG = r"(?P<space>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)"
"""What `owner_tag` writes: pid space, pid, start time; a pattern to embed in a name's own."""


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (ticks since boot), 0 where /proc does not say, None if no such process."""
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
    """Where this process's pids mean something: its boot and pid namespace (8 hex digits)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        import socket

        key = socket.gethostname()
    return f"{zlib.crc32(key.encode()):08x}"


def owner_tag() -> str:
    """This process, as `owner_has_ended` reads it back: ``SPACE-PID-START``."""
    pid = os.getpid()
    return f"{process_space()}-{pid}-{process_start_ticks(pid) or 0}"


def owner_has_ended(tag: str) -> bool | None:
    """True if the process `tag` names has ended (its pid gone or reused), False if it runs (or no /proc says),
    None where this process cannot tell (another machine or pid namespace, or not a tag)."""
    match = re.fullmatch(OWNER_TAG, tag)
    if match is None or match["space"] != process_space():
        return None
    started = process_start_ticks(int(match["pid"]))
    return started is None or started not in (0, int(match["start"]))
