"""Sharded host store for `weight_transfer: "allgather"`: rank r keeps bytes [r*S, (r+1)*S) of every streamed
block's stored bytes (S = ceil(nbytes / N), aligned; the ranks vote that their layouts agree); a transfer copies
the shard into chunk r of a slot and all-gathers the chunks. The weights go only after every rank staged every
shard (host memory peaks at (1 + 1/N) x the streamed bytes). Under `host_budget_gb` a disk block keeps this
rank's shard on disk (`ShardPart`), gathered in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from layerstream.distributed.collectives import BlockGather
from layerstream.errors import UnsupportedUseError
from layerstream.runtime.packing.host_buffer import HostBufferBlock, on_own_thread, page_aligned_empty
from layerstream.runtime.packing.layout import BlockLayout, TensorBinder
from layerstream.runtime.contracts import HostStoreBase, Job, Pinner, StoredBlock, StoredForm, StoreStats
from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.forms.slot import SlotUnpack

logger = logging.getLogger(__name__)


class ShardedBlock(HostBufferBlock):
    """One streamed block of which this rank holds one shard (its `buffer`)."""

    # not tracked: a write-back may touch one rank's shard and not another's, and every rank must decide alike
    # whether to copy (gather) a block again; nothing else writes a shard (state_dict and LoRA are refused)
    host_version = None

    def __init__(self, form: StoredForm, binder: TensorBinder, shard: torch.Tensor, pinner: Pinner | None, gather: BlockGather, index: int):
        self.form = form
        self.layout = form.layout
        self.unpack = SlotUnpack(form)
        self.binder = binder
        self.buffer = shard
        if pinner is not None:
            # now, and waited for: a failure must reach the store's collective failure report (off the compute
            # thread all the same, where a failed registration would poison a later kernel)
            if on_own_thread(pinner.pin_, self.buffer):
                self.pinner = pinner
        self.gather = gather
        self.index = index  # in the gather's headers (the same on every rank)
        self.shard_nbytes = shard.numel()

    def __repr__(self) -> str:
        return f"ShardedBlock({self.path!r}, shard {self.gather.rank}/{self.gather.world_size} of {self.shard_nbytes} bytes)"

    @property
    def link_bytes(self) -> int:
        return self.shard_nbytes  # its own shard crosses this link; the rest arrives from peers

    @property
    def slot_nbytes(self) -> int:
        return self.form.stored_offset + self.gather.world_size * self.shard_nbytes

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        gathered = slot_buffer[self.form.stored_offset : self.slot_nbytes]
        assert slot_buffer.numel() >= self.slot_nbytes, "slots are sized for the largest gathered block"
        gather, index, nbytes, shard, moved = self.gather, self.index, self.form.stored_nbytes, self.buffer, self.shard_nbytes
        unpack = self.unpack

        def job() -> int:
            gather.gather_block_(index, nbytes, shard, gathered)
            # float8, lossless: the casts or decodes into the compute layout, after the gather on the copy stream
            unpack.run_(slot_buffer)
            return moved

        return job

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        raise UnsupportedUseError(
            f"{self.path}: backward through a block streamed with weight_transfer \"allgather\" is not supported "
            "(this rank holds only a shard of its weights); use \"rank-local\" or run under torch.no_grad()"
        )

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        # this rank's shard of what the forward wrote: every rank runs the same forward
        own_start = self.gather.rank * self.shard_nbytes
        return self.form.write_slot_range_(self.buffer, own_start, slot_buffer, start, end)

    def host_tensors(self) -> list[torch.Tensor]:
        raise UnsupportedUseError(
            f"{self.path}: this rank holds only a shard of the block (weight_transfer \"allgather\"); call "
            "handle.disable() on every rank first to read or load its weights"
        )

    def drop_original_(self) -> None:
        self.binder.evict_()
        self.layout.forget_sources()

    def restore_(self, device: torch.device) -> None:
        full = self.gather.gather_full_(self.index, self.form.stored_nbytes, self.buffer)  # a collective
        compute = self.form.compute_bytes(full)  # float8, lossless: upcast or decoded (exact) from the stored bytes
        self.binder.bind_(self.layout.separate_copies(compute, device))
        self.release_()

    def release_(self) -> None:
        self.unpack.clear_()
        self.release_buffer_()


class ShardPart:
    """This rank's shard of a block the disk tier holds (a `contracts.DiskPart`), gathered as a host shard is."""

    keeps_originals = True  # after the commit the full weights exist only across the ranks: roll back before it
    restored_by_host_store = True  # a restore is a collective, in the gather's order (`ShardedHostStore.restore_`)

    def __init__(self, store: ShardedHostStore, form: StoredForm):
        self.store = store
        self.gather = store.gather
        self.form = form
        self.nbytes = self.gather.shard_nbytes(form.stored_nbytes)
        self.start = self.gather.rank * self.nbytes
        self.index: int | None = None  # given when the disk tier stages it
        self.block: StoredBlock | None = None

    def __repr__(self) -> str:
        return f"ShardPart({self.form.layout.path!r}, shard {self.gather.rank}/{self.gather.world_size} of {self.nbytes} bytes)"

    def staged_(self, block: StoredBlock) -> None:
        self.index = self.gather.register_block(self.form.layout.path)  # in staging order, as the host shards
        self.block = block
        self.store.disk_parts[self.form.layout.path] = self

    def fill_(self, out: torch.Tensor, files=None, reader=None) -> int:
        self.form.fill_range_(out, self.start)  # past the block's end `out` keeps the zeros it came with
        return 0

    def to_slot_(self, held: torch.Tensor, slot_buffer: torch.Tensor, non_blocking: bool) -> int:
        gathered = slot_buffer[self.form.stored_offset : self.form.stored_offset + self.gather.world_size * self.nbytes]
        self.gather.gather_block_(self.index, self.form.stored_nbytes, held[: self.nbytes], gathered)
        return self.nbytes  # this rank's shard crossed its link; the rest came from its peers

    def compute_bytes(self, held: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"{self.form.layout.path}: a shard alone has no compute bytes; the sharded store restores it")

    def restore_(self, device: torch.device) -> None:
        held = torch.empty(self.nbytes, dtype=torch.uint8)  # read back from disk, then gathered (a collective)
        self.block.read_into_(held)
        full = self.gather.gather_full_(self.index, self.form.stored_nbytes, held)
        compute = self.form.compute_bytes(full)  # float8, lossless: upcast or decoded (exact) from the stored bytes
        self.block.binder.bind_(self.form.layout.separate_copies(compute, device))


class ShardedHostStore(HostStoreBase):
    """`HostStore` over a `BlockGather`: this rank's shard of every block, gathered into slots on demand."""

    kind = "sharded-allgather"

    def __init__(self, gather: BlockGather, form_of: Callable[[BlockLayout], StoredForm] = PackedForm):
        self.gather = gather
        self.form_of = form_of
        self.blocks: dict[str, ShardedBlock] = {}
        self.disk_parts: dict[str, ShardPart] = {}  # the disk tier's blocks, by path
        self._gathers_in_issue_order = False
        self._committed = False

    def __repr__(self) -> str:
        return f"ShardedHostStore({self.gather!r}, {len(self.blocks)} blocks in host memory, {len(self.disk_parts)} on disk)"

    def disk_part(self, layout: BlockLayout) -> ShardPart:
        return ShardPart(self, self.form_of(layout))

    def place_(self, placement) -> None:  # a `plan.placement.Placement`
        tier = placement.host_tier
        # a disk block's gather waits for its read on the engine's issuing thread; a host block's gather would
        # run at once on the compute thread and could overtake it on one rank and not on another
        self._gathers_in_issue_order = tier is not None and bool(tier.from_disk_paths)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        form = self.form_of(layout)  # the gathered block (after the compute layout, for float8 and lossless)
        return form.stored_offset + self.gather.world_size * self.gather.shard_nbytes(form.stored_nbytes)

    def host_nbytes(self, layout: BlockLayout) -> int:
        return self.gather.shard_nbytes(self.form_of(layout).stored_nbytes)  # this rank's shard

    def stored_form(self, layout: BlockLayout) -> StoredForm:
        return self.form_of(layout)

    def stats(self) -> StoreStats:
        # the whole blocks' figures (this rank keeps 1/N of their stored bytes)
        return StoreStats.of_forms(b.form for b in self.blocks.values())

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        # every rank must shard the same layouts and forms before the first payload; raises on every rank
        self.gather.agree_on_layouts_([self.form_of(l) for l in layouts], slot_nbytes)

    def report_failure_(self, error: BaseException) -> None:
        try:
            self.gather.agree_on_layouts_(failure=error)  # the other ranks learn now instead of at their timeout
        except Exception:  # this rank's own error is the one to report
            logger.exception("telling the other ranks that enable_offload failed did not work")

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> ShardedBlock:
        index = self.gather.register_block(layout.path)  # the block keeps its weights until the commit
        form = self.form_of(layout)
        size = self.gather.shard_nbytes(form.stored_nbytes)
        shard = page_aligned_empty(size, zeroed=True)  # zeros: the padding past the block's end is deterministic
        form.fill_range_(shard, self.gather.rank * size)
        block = ShardedBlock(form, TensorBinder(form.layout, device), shard, pin, self.gather, index)
        if self._gathers_in_issue_order:
            block.copy_waits_on_host = True  # queued behind the disk blocks' gathers (see `place_`)
        self.blocks[layout.path] = block
        return block

    def commit_(self) -> None:
        self.gather.commit_()  # raises on every rank if any rank failed to stage: all of them roll back
        self._committed = True
        for block in self.blocks.values():
            block.drop_original_()

    def rollback_(self) -> None:
        if self._committed:
            return  # only reached if a later step failed: after the commit the blocks live across the ranks
        try:
            self.gather.commit_(failure=RuntimeError("rolled back"))  # tell the peers, if not told yet
        except Exception:  # keep rolling back; this rank's own error is the one to report
            logger.exception("telling the other ranks that enable_offload failed did not work")
        for block in self.blocks.values():
            block.release_()  # the blocks still hold their original weights
        self.blocks.clear()
        self.disk_parts.clear()  # the disk tier gives those blocks their original weights back

    def release_(self) -> None:
        for path in list(self.blocks):  # no collective: peers may be gone
            self.blocks.pop(path).release_()
        self.disk_parts.clear()

    def restore_(self, device: torch.device) -> None:
        # in the gather's order, host and disk shards alike, each forgotten once restored: a restore is a
        # collective that can fail (a peer gone), and disable() again must not restore a block twice. The disk tier
        # stopped reading ahead first
        pending = sorted([*self.blocks.values(), *self.disk_parts.values()], key=lambda b: b.index)
        for item in pending:
            item.restore_(device)
            if isinstance(item, ShardPart):
                del self.disk_parts[item.form.layout.path]
            else:
                del self.blocks[item.path]
