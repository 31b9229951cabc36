"""Errors of the offload runtime (defined in `layerstream.errors`, kept importable from here)."""

from layerstream.errors import ConcurrentUseError, OffloadError, TransferError, UnsupportedUseError

__all__ = ["ConcurrentUseError", "OffloadError", "TransferError", "UnsupportedUseError"]
