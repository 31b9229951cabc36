"""Reading back the settings a job's output file carries (written when it was encoded, see
`layerstream.outputs`: PNG text chunks, or the MP4's ``comment`` metadata)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layerstream.outputs import SETTINGS_KEY, read_output_metadata

__all__ = ["SETTINGS_KEY", "read_settings"]


def read_settings(path: Path) -> dict[str, Any]:
    """The settings written into a job's output file (PNG or MP4)."""
    return read_output_metadata(path)
