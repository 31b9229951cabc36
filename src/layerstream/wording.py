"""How messages word an error, a size and a time: `first_line` of an error, bytes in decimal units
(`format_bytes`), seconds as people read them (`format_seconds`)."""

from __future__ import annotations

GB = 1e9
"""A gigabyte as the config's ``*_gb`` keys, the planner and every message count it."""


def first_line(error: BaseException, *, with_type: bool = False) -> str:
    """The first non-blank line of `error`'s message (a traceback or a long library message stays out of a
    one-line refusal), after ``TypeName: `` if `with_type`; its type's name alone when the message is empty."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0]}" if with_type else lines[0]


def format_bytes(nbytes: float) -> str:
    """Bytes in decimal units (`GB`), three significant figures, each unit from a tenth of it: ``512 B``,
    ``4.1 kB``, ``0.45 GB``, ``97 MB``, ``12.3 GB``."""
    if abs(nbytes) < 1000:
        return f"{nbytes:.0f} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", GB)):
        if abs(nbytes) < scale * 100:  # from a hundred units on: a tenth of the next
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes / 1e12:.3g} TB"


def format_seconds(seconds: float) -> str:
    """Seconds as people read them, three significant figures: ``185 ns``, ``7.8 ms``, ``1.23 s``, ``95 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}" if seconds < 1000 else f"{seconds:,.0f} s"
    return f"{seconds / 1e-9:.3g} ns" if seconds else "0 s"
