"""`HistorySettings`: where jobs and their outputs are kept, and how many of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from layerstream.errors import LayerstreamError

MAX_JOBS_LIMIT = 10**9
MAX_OUTPUT_BYTES_LIMIT = 1 << 60


class HistorySettingsError(LayerstreamError, ValueError):
    """A history setting outside what is allowed; names the setting, the value and the allowed range."""


@dataclass(frozen=True, kw_only=True)
class HistorySettings:
    """The data folder and the retention limits of the job history."""

    data_dir: Path
    """Holds ``jobs.sqlite3`` and ``outputs/``; created if missing."""
    max_jobs: int | None = None
    """Most finished jobs kept, the oldest going first (None: no limit)."""
    max_output_bytes: int | None = None
    """Most bytes of output files kept, the oldest finished jobs going first (None: no limit)."""

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, Path):
            raise HistorySettingsError(f"data_dir = {self.data_dir!r} is not valid; expected a folder path")
        _check_limit("max_jobs", self.max_jobs, MAX_JOBS_LIMIT)
        _check_limit("max_output_bytes", self.max_output_bytes, MAX_OUTPUT_BYTES_LIMIT)


def _check_limit(name: str, value: object, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise HistorySettingsError(f"{name} = {value!r} is not valid; expected an integer from 1 to {high}, or none")
