"""The package's error base and the runtime's errors.

Every error layerstream defines derives from `LayerstreamError`, so ``except LayerstreamError`` catches
everything the package raises on purpose. Errors a user caused also derive from ``ValueError`` or
``TypeError``; errors of a running transfer from ``RuntimeError``. Resource errors (out of memory on the
device or the host) and ``KeyboardInterrupt`` are never wrapped: they come out as themselves.
"""

from __future__ import annotations


class LayerstreamError(Exception):
    """Base of every error the layerstream package defines."""


class OffloadError(LayerstreamError, ValueError):
    """Offload cannot be enabled on this pipeline as configured; nothing was changed."""


class UnsupportedTensorError(OffloadError, TypeError):
    """A streamed block holds a tensor whose bytes layerstream cannot pack (a tensor subclass without storage of
    its own, such as a quantized weight); raised at enable, before anything changes. Names the tensor and type."""


class ConcurrentUseError(LayerstreamError, RuntimeError):
    """A second thread entered a streamed model while another thread was running it."""


class TransferError(LayerstreamError, RuntimeError):
    """A weight transfer failed (a copy job raised, or a collective of the allgather transfer failed)."""


class UnsupportedUseError(LayerstreamError, RuntimeError):
    """A PyTorch operation on a streamed model that layerstream cannot make exact; refused before it changes
    anything (the message says what to do instead, usually `handle.disable()` first)."""
