"""Errors of the offload runtime."""

from __future__ import annotations


class OffloadError(ValueError):
    """Offload cannot be enabled on this pipeline as configured; nothing was changed."""


class ConcurrentUseError(RuntimeError):
    """A second thread entered a streamed model while another thread was running it."""


class TransferError(RuntimeError):
    """A weight transfer failed (for example a collective of the allgather transfer)."""
