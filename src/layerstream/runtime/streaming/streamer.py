"""The block streamer: hooks that keep each streamed block in a device slot only while it runs, bound to views of
it, and prefetch the blocks predicted to run next (the declared order at first, then the order blocks actually
run in). A slot is read for a block only while the store's bytes are those its copy was issued from
(`host_version`); writers the version does not see call `forget_copy_`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from layerstream.errors import TransferError, UnsupportedUseError
from layerstream.runtime.streaming.ownership import CallOwnership
from layerstream.runtime.contracts import CopyEngine, CopyRecord, StoredBlock
from layerstream.runtime.torch_contract.saved_tensors import slot_saved_tensor_hooks

MAX_TRACE_RECORDS = 20_000
RELEARN_AFTER = 2  # times in a row a new successor is seen before it replaces the learned one (a one-off detour)


@dataclass
class ComputeRecord:
    """One run of a block: when compute waited, started and ended (the engine's marks, resolved after the run)."""

    label: str
    slot: int
    wait_start: object
    start: object
    end: object = 0.0
    sync_load: bool = False


@dataclass(slots=True, eq=False)
class BlockCounters:
    """Transfer counters of one component (plain ints: the hot path), named as the `ComponentStats` fields."""

    bytes_transferred: int = 0
    num_transfers: int = 0
    num_sync_loads: int = 0
    stall_seconds: float = 0.0
    copy_issue_seconds: float = 0.0  # host time compute spent handing copies to the engine
    bytes_written_back: int = 0


@dataclass
class _Binding:
    """A block bound to a slot for one call (the slot's version moves with an in-place write into it)."""

    record: ComputeRecord
    slot_version: int
    saved_hooks: object = None


@dataclass(eq=False, repr=False, slots=True)
class StreamedBlock:
    """One streamed block as the streamer schedules it (slotted plain attributes: read on the hot path)."""

    index: int
    host: StoredBlock
    component: str
    module: nn.Module
    counters: BlockCounters
    depth: int
    next_index: int = -1  # set from the chain order, then learned
    learned: bool = False  # whether next_index comes from an observed transition
    candidate: int = -1  # a different successor seen lately, and how many times in a row
    candidate_hits: int = 0
    slot: int | None = None  # slot holding (or receiving) this block's bytes
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # slot -> views of that slot, built once
    num_transfers: int = 0
    buffer_ranges: list[tuple[int, int]] = field(init=False)  # what a forward may write that must be kept
    copied_version: int | None = field(init=False)  # the store's bytes the latest copy into `slot` came from

    def __post_init__(self) -> None:
        self.next_index = self.index
        self.buffer_ranges = self.host.layout.buffer_byte_ranges()
        self.copied_version = self.host.host_version

    @property
    def path(self) -> str:
        return self.host.path


class BlockStreamer:
    """Schedules the slot ring for every streamed block of a pipeline (all components share the slots)."""

    def __init__(
        self,
        blocks: list[StreamedBlock],
        chains: list[list[int]],
        engine: CopyEngine,
        slot_buffers: list[torch.Tensor],
        ownership: CallOwnership | None = None,
    ):
        self.blocks = blocks
        self.engine = engine
        self.slot_buffers = slot_buffers
        self.num_slots = len(slot_buffers)
        self.slot_block: list[int | None] = [None] * self.num_slots
        self.slot_in_use = [False] * self.num_slots
        self.slot_tick = [0] * self.num_slots
        self._tick = 0
        for chain in chains:
            for pos, index in enumerate(chain):
                blocks[index].next_index = chain[(pos + 1) % len(chain)]
        self._index_of = {block.path: block.index for block in blocks}
        self._last_index: int | None = None
        self.num_materialized = 0
        self.max_materialized = 0
        self.compute_records: deque[ComputeRecord] = deque(maxlen=MAX_TRACE_RECORDS)
        self.ownership = ownership if ownership is not None else CallOwnership()
        self._depth = 0  # nesting of the owner's streamed component calls
        self._active: dict[int, _Binding] = {}
        self._slot_of_storage = {buffer.untyped_storage().data_ptr(): slot for slot, buffer in enumerate(slot_buffers)}
        self._bound_in_slot: list[int | None] = [None] * self.num_slots
        self._updating: dict[int, int] = {}  # block index -> slot, for blocks bound by bind_for_update_

    # ownership: one thread at a time may run the streamed models (they share the slots) ---------------------
    def enter(self) -> None:
        """Enter a streamed component's call (refused in a thread that does not own the pipeline's calls)."""
        self.ownership.enter()
        self._depth += 1

    def exit(self) -> None:
        if not self.ownership.held_here():
            return
        self._depth -= 1
        if self._depth <= 0:
            self._depth = 0
            # the outermost streamed call is over: no block may still be bound. One is only if a block was left
            # by an exception its post-forward hook never saw (torch skips hooks on KeyboardInterrupt); give its
            # slot back so the next call starts clean
            self._release_abandoned_()
        self.ownership.exit()

    def _release_abandoned_(self) -> None:
        if not self._active:
            return
        for index in list(self._active):
            self.post_forward(self.blocks[index], None)
        self._last_index = None  # do not learn a transition from an aborted forward

    # hooks ---------------------------------------------------------------------------------------------------
    def pre_forward(self, block: StreamedBlock) -> None:
        self.ownership.check()
        if self.engine.capturing():
            raise UnsupportedUseError(
                f"{block.path}: a streamed block was called while the stream is being captured into a CUDA graph "
                "(torch.cuda.graph, or torch.compile mode=\"reduce-overhead\" over the whole model); streaming "
                "waits on events and copies on a side stream, which a graph cannot replay. Compile the blocks "
                "without CUDA graphs instead (compile_repeated_blocks, or mode=\"default\"/\"max-autotune-no-cudagraphs\")"
            )
        if torch.is_grad_enabled() and block.host.binder.any_requires_grad():
            raise UnsupportedUseError(
                f"{block.path}: a streamed block's weights cannot receive gradients (they are placeholders again "
                "when backward runs). For gradients with respect to the inputs (guidance, inversion), freeze the "
                "weights with model.requires_grad_(False); for inference run under torch.no_grad() or "
                "torch.inference_mode(); to train, call handle.disable() first"
            )
        if self._depth == 0 and self._active:
            self._release_abandoned_()  # a block called outside its component was left bound by a Ctrl-C
        index = block.index
        last = self._last_index
        if last is not None and last != index:
            self._learn(last, index)
        self._last_index = index

        wait_start = self.engine.now()
        slot, sync_load, stall = self._bind_ready_slot_(block)
        if stall:
            block.counters.stall_seconds += stall
            block.host.count_stall_(stall)  # a block with a source of its own (the disk) counts its part
        self._tick += 1
        self.slot_tick[slot] = self._tick
        self.num_materialized += 1
        if self.num_materialized > self.max_materialized:
            self.max_materialized = self.num_materialized
        record = ComputeRecord(block.path, slot, wait_start, self.engine.now(), sync_load=sync_load)
        binding = _Binding(record, self.slot_buffers[slot]._version)
        self._active[index] = binding
        self._bound_in_slot[slot] = index
        self.compute_records.append(record)
        if torch.is_grad_enabled():
            # autograd may save slot tensors for backward; keep them as references into the host store
            binding.saved_hooks = slot_saved_tensor_hooks(self._slot_owner)
            binding.saved_hooks.__enter__()

        self._prefetch_after(block)

    def _bind_ready_slot_(self, block: StreamedBlock) -> tuple[int, bool, float]:
        """Bind the block to a slot holding its bytes, once its copy is done: (slot, loaded synchronously, stall)."""
        self._forget_outdated_copy_(block)
        slot = block.slot
        sync_load = slot is None
        if sync_load:
            block.counters.num_sync_loads += 1
            slot = self._free_slot(keep=())
            self._issue_copy(block, slot)
        try:
            stall = self.engine.wait_ready(slot)
        except TransferError:
            self._drop_copy_(block, slot)  # no complete copy: a later call copies again instead of reading it
            raise
        self.slot_in_use[slot] = True
        views = block.views.get(slot)
        if views is None:
            views = block.views[slot] = block.host.layout.views(self.slot_buffers[slot])
        block.host.binder.bind_(views)
        return slot, sync_load, stall

    def _drop_copy_(self, block: StreamedBlock, slot: int) -> None:
        self.slot_block[slot] = None
        block.slot = None

    def post_forward(self, block: StreamedBlock, output, *, failed: bool = False) -> None:
        binding = self._active.pop(block.index, None)
        if binding is None:
            return  # pre-forward failed before binding (e.g. refused thread): nothing to release
        record = binding.record
        record.end = self.engine.now()
        if binding.saved_hooks is not None:
            binding.saved_hooks.__exit__(None, None, None)
        self._bound_in_slot[record.slot] = None
        slot_buffer = self.slot_buffers[record.slot]
        if slot_buffer._version != binding.slot_version and block.buffer_ranges:
            # something wrote into the slot in place (BatchNorm statistics, a step counter): keep the buffers'
            # new bytes in the store, or the next call would read the old ones
            for start, end in block.buffer_ranges:
                block.counters.bytes_written_back += block.host.write_back_(slot_buffer, start, end)
        block.host.binder.evict_()
        self.num_materialized -= 1
        self.slot_in_use[record.slot] = False  # the slot the block was bound to, whatever it holds next
        self.engine.release(record.slot)
        if failed or (output is None and sys.exc_info()[1] is not None):
            # the block raised: do not learn the next transition from an aborted forward
            self._last_index = None

    def _slot_owner(self, t: torch.Tensor):
        """(the bound block's store entry, byte offset in the slot) for a tensor viewing a slot, else None."""
        try:
            address = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a subclass): not a slot
            return None
        slot = self._slot_of_storage.get(address)
        if slot is None:
            return None
        index = self._bound_in_slot[slot]
        if index is None:
            return None
        return self.blocks[index].host, t.data_ptr() - self.slot_buffers[slot].data_ptr()

    def forget_copy_(self, block: StreamedBlock) -> None:
        """The block's bytes in the store changed (`load_state_dict`): the next call copies again. A copy still in
        flight may read the store while it is written: the slot is never read for this block again, and the new
        copy is queued after the write (an engine runs a slot's copies in the order they were asked for)."""
        if block.slot is not None and not self.slot_in_use[block.slot]:
            self._drop_copy_(block, block.slot)

    def _forget_outdated_copy_(self, block: StreamedBlock) -> None:
        # one version read per block and call: a copy again only after a write in place (state_dict, write-back)
        if block.slot is not None and block.copied_version != block.host.host_version:
            self.forget_copy_(block)

    # changing weights between calls (LoRA fusing) ------------------------------------------------------------
    def bind_for_update_(self, block: StreamedBlock) -> None:
        """Bind an idle block to a slot outside any forward, for code that changes its weights in place."""
        self.ownership.check()
        assert block.index not in self._active and block.index not in self._updating, f"{block.path} is bound"
        self._updating[block.index] = self._bind_ready_slot_(block)[0]

    def unbind_after_update_(self, block: StreamedBlock) -> None:
        """Write the block bound by `bind_for_update_` back into the host store (the slot keeps the same bytes)."""
        slot = self._updating.pop(block.index)
        try:
            block.host.binder.keep_replaced_(block.views[slot])
            # a host-side copy from the device: it waits for the writes into the slot, which must finish first
            block.host.write_back_(self.slot_buffers[slot], 0, block.host.layout.nbytes)
            block.copied_version = block.host.host_version  # the slot holds exactly the bytes just stored
        except BaseException:
            self._drop_copy_(block, slot)  # the slot may hold bytes the store does not: never read it again
            raise
        finally:
            block.host.binder.evict_()
            self.slot_in_use[slot] = False
            self.engine.release(slot)

    # scheduling ----------------------------------------------------------------------------------------------
    def successor(self, path: str) -> str | None:
        """The block predicted to run after `path`; None for a block this streamer does not hold. Thread-safe."""
        index = self._index_of.get(path)
        return None if index is None else self.blocks[self.blocks[index].next_index].path

    def _learn(self, last: int, index: int) -> None:
        prev = self.blocks[last]
        if prev.next_index == index:
            prev.learned = True
            prev.candidate_hits = 0
        elif not prev.learned:
            prev.next_index, prev.learned = index, True  # the first observation replaces the declared guess
        elif prev.candidate == index:
            prev.candidate_hits += 1
            if prev.candidate_hits >= RELEARN_AFTER:
                prev.next_index, prev.candidate_hits = index, 0
        else:
            prev.candidate, prev.candidate_hits = index, 1

    def _prefetch_after(self, block: StreamedBlock) -> None:
        wanted = []
        index = block.index
        for _ in range(block.depth):
            index = self.blocks[index].next_index
            if index == block.index or index in wanted:
                break
            wanted.append(index)
        keep = tuple(wanted) + (block.index,)
        for index in wanted:
            target = self.blocks[index]
            self._forget_outdated_copy_(target)
            if target.slot is None:
                slot = self._free_slot(keep=keep)
                if slot is None:
                    return
                self._issue_copy(target, slot)

    def _free_slot(self, keep: tuple[int, ...]) -> int | None:
        """The least recently used slot that compute is not reading and that holds no block in `keep`."""
        best = None
        for slot in range(self.num_slots):
            if self.slot_in_use[slot]:
                continue
            occupant = self.slot_block[slot]
            if occupant is not None and occupant in keep:
                continue
            if occupant is None:
                return slot
            if best is None or self.slot_tick[slot] < self.slot_tick[best]:
                best = slot
        if best is None and not keep:
            raise RuntimeError(
                f"all {self.num_slots} device slots are in use by running blocks; nested streamed blocks need a "
                "larger prefetch_depth"
            )
        return best

    def _issue_copy(self, block: StreamedBlock, slot: int) -> None:
        occupant = self.slot_block[slot]
        if occupant is not None:
            self.blocks[occupant].slot = None
        self.slot_block[slot] = block.index
        block.slot = slot
        block.copied_version = block.host.host_version  # read before the job: a later write makes it outdated
        self._tick += 1
        self.slot_tick[slot] = self._tick
        host = block.host
        nbytes = host.link_bytes
        block.num_transfers += 1
        block.counters.num_transfers += 1
        block.counters.bytes_transferred += nbytes
        issuing = time.perf_counter()
        try:
            job = host.copy_job(self.slot_buffers[slot])
            self.engine.copy_into(slot, job, CopyRecord(block.path, slot, nbytes), waits_on_host=host.copy_waits_on_host)
        except BaseException:
            # an engine that ran the job in this thread raised (a failed collective): no complete copy in the slot
            self._drop_copy_(block, slot)
            raise
        issued = time.perf_counter() - issuing
        block.counters.copy_issue_seconds += issued
        host.count_stall_(issued)  # an engine that ran the job here waited for its source meanwhile
