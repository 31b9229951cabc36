"""`ServeSettings`: the server's limits and switches, validated when built."""

from __future__ import annotations

from layerstream.errors import LayerstreamError
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class ServeSettingsError(LayerstreamError, ValueError):
    """A server setting outside what is allowed; names the setting, the value and the allowed range."""


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """How the server binds and what it lets a request ask for."""

    host: str = DEFAULT_HOST
    """Address to bind; loopback by default so that nothing is exposed unless asked for."""
    port: int = DEFAULT_PORT
    """TCP port; 0 picks a free one (the ready line names it)."""
    max_queue: int = 16
    """Requests that may wait behind the running one; one more answers 429."""
    max_frames: int = 129
    """Largest ``num_frames`` a video request may ask for."""
    max_side_pixels: int = 2048
    """Largest width or height a request may ask for."""
    max_body_bytes: int = 1 << 20
    """Largest request body; a larger one answers 413 without being parsed."""
    fault_prompt: str | None = None
    """Test-only: a request with exactly this prompt raises inside a transformer block (see `faults`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ServeSettingsError(f"host = {self.host!r} is not valid; expected an address such as 127.0.0.1")
        _check_int("port", self.port, low=0, high=65535)
        _check_int("max_queue", self.max_queue, low=0, high=1_000_000)
        _check_int("max_frames", self.max_frames, low=1, high=100_000)
        _check_int("max_side_pixels", self.max_side_pixels, low=1, high=1_000_000)
        _check_int("max_body_bytes", self.max_body_bytes, low=1024, high=1 << 30)
        if self.fault_prompt is not None and (not isinstance(self.fault_prompt, str) or not self.fault_prompt):
            raise ServeSettingsError(f"fault_prompt = {self.fault_prompt!r} is not valid; expected a non-empty string")


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ServeSettingsError(f"{name} = {value!r} is not valid; expected an integer from {low} to {high}")
