"""Sharded host store for `weight_transfer: "allgather"`: each rank keeps 1/N of every streamed block.

Every rank computes the same `BlockLayout` for a block (the ranks load the same model; enable checks the
layouts agree), so the packed bytes are the same on every rank. Rank r keeps bytes [r*S, (r+1)*S) of them,
with S = ceil(nbytes / N) rounded up to `ALIGN_BYTES`; the last shard is zero-padded. A transfer copies the
local shard into chunk r of a device slot and all-gathers the chunks, so the slot then holds the whole packed
block and the block's views read it exactly as with a plain `HostBlock`.

Staging and dropping are separate steps, unlike `pack_block_`: a block's shard is staged while the block
keeps its original weights, and the weights go (`drop_original_`) only after every rank has staged every
shard. Until then, rolling back is local to each rank; afterwards, the full weights exist only across the
ranks. Host memory peaks at (1 + 1/N) x the streamed bytes during enable, never at two copies.
"""

from __future__ import annotations

import torch

from layerstream.distributed.collectives import BlockGather
from layerstream.runtime.host_store import BlockLayout, HostBlock, TensorBinder


class ShardedHostBlock(HostBlock):
    """One streamed block of which this rank holds one shard (its `buffer`); the streamer sees a `HostBlock`."""

    def __init__(self, layout: BlockLayout, binder: TensorBinder, shard: torch.Tensor, pinned: bool, gather: BlockGather, index: int):
        super().__init__(layout, binder, shard, pinned)
        self.gather = gather
        self.index = index
        """The block's index in the gather's headers (the same on every rank)."""
        self.shard_nbytes = shard.numel()

    @property
    def shard(self) -> torch.Tensor:
        return self.buffer

    def __repr__(self) -> str:
        return f"ShardedHostBlock({self.path!r}, shard {self.gather.rank}/{self.gather.world_size} of {self.shard_nbytes} bytes)"

    @property
    def link_bytes(self) -> int:
        """Bytes one transfer moves over this process's host link: its own shard (the rest arrives from peers)."""
        return self.shard_nbytes

    @property
    def slot_nbytes(self) -> int:
        """Bytes the gathered block occupies in a device slot: one shard per rank."""
        return self.gather.world_size * self.shard_nbytes

    def copy_job(self, slot_buffer: torch.Tensor):
        """A job for the copy engine that gathers this block into `slot_buffer`; returns the bytes it moved."""
        gathered = slot_buffer[: self.slot_nbytes]
        assert gathered.numel() == self.slot_nbytes, "slots are sized for the largest gathered block"
        gather, index, nbytes, shard, moved = self.gather, self.index, self.layout.nbytes, self.shard, self.shard_nbytes

        def job() -> int:
            gather.gather_block_(index, nbytes, shard, gathered)
            return moved

        return job

    def full_bytes(self) -> torch.Tensor:
        """The whole block's bytes, gathered from every rank (a collective: every rank restores in one order)."""
        return self.gather.gather_full_(self.index, self.layout.nbytes, self.shard)

    def drop_original_(self) -> None:
        """Evict the block to placeholders and let its original storage go (after every rank staged)."""
        self.binder.evict_()
        self.layout.forget_sources()


def stage_sharded_block(layout: BlockLayout, gather: BlockGather, device: torch.device, *, pin=None) -> ShardedHostBlock:
    """Copy this rank's shard of a block into a host buffer of its own; the block keeps its weights for now.

    `pin` is the copy engine's page-locking function (None keeps the shard pageable)."""
    index = gather.register_block(layout.path)
    size = gather.shard_nbytes(layout.nbytes)
    shard = torch.zeros(size, dtype=torch.uint8)  # zeros: the padding past the block's end is deterministic
    layout.copy_range_into(shard, gather.rank * size)
    pinned = bool(pin(shard)) if pin is not None else False
    return ShardedHostBlock(layout, TensorBinder(layout, device), shard, pinned, gather, index)
