"""How messages word an error and a size: `first_line` of an error, and bytes in the config's decimal units
(`format_gb`) or in the binary units of the runtime's figures (`format_bytes`)."""

from __future__ import annotations

GB = 1e9
"""A gigabyte as the config's ``*_gb`` keys count it."""


def first_line(error: BaseException, *, with_type: bool = False) -> str:
    """The first non-blank line of `error`'s message (a traceback or a long library message stays out of a
    one-line refusal), after ``TypeName: `` if `with_type`; its type's name alone when the message is empty."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0]}" if with_type else lines[0]


def format_gb(nbytes: float) -> str:
    """Bytes in decimal units, as the config's keys count them: ``12.3 GB``, or ``450 MB`` below a tenth of a GB."""
    return f"{nbytes / GB:.3g} GB" if abs(nbytes) >= GB / 10 else f"{nbytes / 1e6:.3g} MB"


def format_bytes(num_bytes: int) -> str:
    """Bytes in binary units, as the runtime's figures read: ``512 B``, ``3.2 KiB``, ``1.5 GiB``."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
