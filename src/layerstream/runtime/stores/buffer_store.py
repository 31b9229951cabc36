"""What the stores that keep whole blocks in host buffers of this process share (the packed and the float8 store):
their blocks by path, each a `HostBufferBlock`, page-locked off the caller's thread by one `PinningThread`."""

from __future__ import annotations

import torch

from layerstream.runtime.contracts import HostStoreBase
from layerstream.runtime.packing.host_buffer import HostBufferBlock, PinningThread


class HostBufferStore(HostStoreBase):
    """A `HostStore` whose blocks are host buffers of this process: how they are released and restored."""

    def __init__(self) -> None:
        self.blocks: dict[str, HostBufferBlock] = {}
        self._pinning = PinningThread()

    def release_(self) -> None:
        """The model was dropped without `disable()`: free (and unpin) every host buffer, restoring nothing."""
        self._pinning.finish(raise_errors=False)  # a buffer is unpinned only once its pinning is over
        for path in list(self.blocks):
            self.blocks.pop(path).release_()

    def restore_(self, device: torch.device) -> None:
        # one block at a time, forgotten once restored: a second call never restores a block twice
        for path in list(self.blocks):
            self.blocks[path].restore_(device)
            del self.blocks[path]
