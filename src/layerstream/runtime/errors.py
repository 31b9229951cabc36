"""Deprecated import path, kept until 0.2: the runtime's errors live in `layerstream.errors` (and are exported
from `layerstream`). Importing this module warns, naming the new path."""

import warnings

from layerstream.errors import ConcurrentUseError, OffloadError, TransferError, UnsupportedUseError

warnings.warn(
    "layerstream.runtime.errors is deprecated and will be removed in 0.2; import these errors from "
    "layerstream.errors (or from layerstream)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ConcurrentUseError", "OffloadError", "TransferError", "UnsupportedUseError"]
