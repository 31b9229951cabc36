"""The contracts the streamer and the mode backends talk to: where a block's bytes live (`HostStore`, one
`StoredBlock` per block), in which form (`StoredForm`), and how they move (`CopyEngine`), with defaults in
`HostStoreBase` / `StoredBlockBase`. A store's lifecycle: `slot_nbytes` / `host_nbytes` (pure) -> `place_` ->
`check_layouts_` (before anything changes) -> `stage_` per block -> `commit_` -> `follow_order_` -> copies ->
`restore_` at disable (after the engine is closed); before the commit, `rollback_` gives the originals back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.packing.layout import BlockLayout, TensorBinder
from layerstream.runtime.forms.packed import PackedForm
from layerstream.runtime.forms.slot import stored_region

if TYPE_CHECKING:
    from layerstream.plan.placement import Placement

Job = Callable[[], int]  # moves one block's bytes into a slot; returns the bytes that crossed this process's link


@dataclass
class CopyRecord:
    """One copy as seen by the copy side (times in seconds on the engine's clock)."""

    label: str
    slot: int
    nbytes: int
    start: float = 0.0
    end: float = 0.0


class Pinner(Protocol):
    """Page-locks host buffers for the device's DMA engine (the copy engine is one)."""

    def pin_(self, buffer: torch.Tensor) -> bool: ...

    def unpin_(self, buffer: torch.Tensor) -> None: ...


@runtime_checkable
class StoredForm(Protocol):
    """How a block's bytes are kept off the device, and how they become its compute layout in a slot. Pure."""

    layout: BlockLayout  # the compute layout: what a slot holds while the block computes
    lossless: bool  # the stored bytes give back the original tensors exactly (float8 rounds)
    stored_is_packed: bool
    """The stored bytes are the packed layout byte for byte: checkpoint file ranges can serve them, and the
    original tensors may go as soon as the block is staged."""
    coded: bool  # a code no tensor can view: host tensors are decoded copies, coded again when written

    @property
    def stored_nbytes(self) -> int: ...  # what a store keeps of the block, what a whole transfer moves

    @property
    def stored_offset(self) -> int: ...  # where in a slot the stored bytes land: 0 packed, else after the layout

    @property
    def slot_nbytes(self) -> int: ...  # `stored_offset + stored_nbytes`

    @property
    def signature(self) -> str: ...  # how the bytes are stored, in words (ranks compare it)

    def fill_(self, stored: torch.Tensor, files: MappedFiles | None = None, reader: FileReader | None = None) -> int:
        """Write the stored bytes from the originals (file-backed views read by `reader`); returns those bytes."""

    def fill_range_(self, out: torch.Tensor, start: int) -> None:
        """Write stored bytes [start, start + out.numel()); bytes past the block stay as they are (zero padding)."""

    def unpack_ops(self, slot_buffer: torch.Tensor) -> list:
        """The ops (`run_()` on the copy's thread and stream) that make a slot's stored bytes the compute layout."""

    def compute_bytes(self, stored: torch.Tensor) -> torch.Tensor: ...  # for restoring real tensors

    def compute_range(self, stored: torch.Tensor, start: int, nbytes: int) -> torch.Tensor: ...

    def stored_tensors(self, stored: torch.Tensor) -> list[torch.Tensor]: ...  # views, in the stored dtype (uncoded)

    def write_slot_range_(self, stored: torch.Tensor, stored_start: int, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        """Store compute-layout bytes [start, end) of `slot_buffer` into `stored` (stored bytes from `stored_start`);
        returns the stored bytes written. Raises `UnsupportedUseError`, before writing, where values do not fit."""


@runtime_checkable
class StoredBlock(Protocol):
    """One block held by a host store: what the streamer needs to bind it and to copy it into a slot."""

    layout: BlockLayout
    binder: TensorBinder

    @property
    def path(self) -> str: ...

    @property
    def host_bytes(self) -> int: ...  # held by this process for the block

    @property
    def pinned(self) -> bool: ...

    @property
    def link_bytes(self) -> int: ...  # one transfer of the block moves these over this process's host link

    copy_waits_on_host: bool
    """The copy job may wait on the host (a disk read): an accelerator engine runs it on a thread of its own, so
    that compute goes on queuing kernels meanwhile."""

    def copy_job(self, slot_buffer: torch.Tensor) -> Job: ...  # fills a whole slot with the block's packed bytes

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        """Packed bytes [start, start + nbytes) on the host, for autograd (`UnsupportedUseError` where not held)."""

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        """Copy bytes [start, end) of a buffer the block wrote in `slot_buffer` back to the store; returns them."""

    def host_tensors(self) -> list[torch.Tensor]:
        """One host tensor per entry, viewing the store's bytes (`UnsupportedUseError` where not held whole)."""

    def sync_host_tensors_(self, written: bool) -> None:
        """The caller is done with `host_tensors()`; with `written` the store takes their values (codes them)."""

    def check_lora_(self) -> None: ...  # raises `UnsupportedUseError` where LoRA may not change the block

    def count_stall_(self, stall_seconds: float) -> None: ...  # compute waited so long: a disk block counts its part

    @property
    def host_version(self) -> int | None:
        """Torch's version counter of the host buffer (shared by every view): a slot copied from an older version
        must be copied again. None where writes are not tracked (writers call `BlockStreamer.forget_copy_`)."""


@runtime_checkable
class HostStore(Protocol):
    """Keeps streamed blocks' bytes off the device (see the module docstring for the lifecycle)."""

    kind: str

    def slot_nbytes(self, layout: BlockLayout) -> int: ...  # pure; the placement sizes the slots from it

    def host_nbytes(self, layout: BlockLayout) -> int: ...  # pure; the placement prices the host tier in it

    def stored_form(self, layout: BlockLayout) -> StoredForm: ...  # pure; the disk tier keeps the same form

    def disk_part(self, layout: BlockLayout) -> DiskPart: ...  # pure; what it keeps where the disk tier holds it

    def place_(self, placement: Placement) -> None: ...  # the placement's decisions, before `check_layouts_`

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        """After the commit: the streamer's prediction of the next block (the disk tier reads ahead along it)."""

    def stats(self) -> StoreStats: ...

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        """`OffloadError` before anything changes where the store cannot hold these blocks (or the ranks disagree)."""

    def report_failure_(self, error: BaseException) -> None: ...  # failed before or while staging: tell any peer

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> StoredBlock:
        """Take the block's bytes into the store; from now on the block may hold placeholders."""

    def commit_(self) -> None: ...  # every block is staged: the store's copy becomes the only one

    def rollback_(self) -> None: ...  # undo every `stage_` (before the commit): the original tensors come back

    def restore_(self, device: torch.device) -> None:
        """Give every block real tensors on `device` again and free the host memory. The caller has closed the
        copy engine first: no copy may still read a host buffer."""

    def release_(self) -> None:
        """The model was dropped without `disable()`: free host memory and spill files, restoring nothing and
        telling no peer. The caller has closed the copy engine first."""


@runtime_checkable
class DiskPart(Protocol):
    """What this process keeps of one disk-tier block (stored bytes [start, start + nbytes)), and how to a slot."""

    form: StoredForm
    start: int  # the first stored byte of the part (0 for a whole block; rank r's shard starts at r x its size)
    nbytes: int  # bytes of the part (a shard's zero padding past the block's end included)
    keeps_originals: bool
    """The block keeps its original tensors until the commit, so that a rollback need not read the part back."""
    restored_by_host_store: bool
    """The full bytes exist only across ranks: the host store restores the block (a collective), not the disk store."""

    def staged_(self, block: StoredBlock) -> None: ...  # the sharded store registers it, in staging order

    def fill_(self, out: torch.Tensor, files: MappedFiles | None, reader: FileReader | None) -> int:
        """Write the part (`out` zeroed by the caller) from the original tensors; returns the bytes read from files."""

    def to_slot_(self, held: torch.Tensor, slot_buffer: torch.Tensor, non_blocking: bool) -> int:
        """Move the part in `held[:nbytes]` into the slot (a shard: all-gathered); returns the bytes over the link."""

    def compute_bytes(self, held: torch.Tensor) -> torch.Tensor: ...  # from the part read back (whole parts only)


class WholePart:
    """The `DiskPart` of every store that keeps blocks whole: the block's stored bytes, in its form."""

    start = 0
    restored_by_host_store = False

    def __init__(self, form: StoredForm):
        self.form = form
        self.nbytes = form.stored_nbytes
        self.keeps_originals = not form.stored_is_packed

    def __repr__(self) -> str:
        return f"WholePart({self.form!r})"

    def staged_(self, block: StoredBlock) -> None:
        pass  # nobody else needs to know

    def fill_(self, out: torch.Tensor, files: MappedFiles | None, reader: FileReader | None) -> int:
        return self.form.fill_(out, files, reader)

    def to_slot_(self, held: torch.Tensor, slot_buffer: torch.Tensor, non_blocking: bool) -> int:
        stored_region(self.form, slot_buffer).copy_(held[: self.nbytes], non_blocking=non_blocking)
        return self.nbytes

    def compute_bytes(self, held: torch.Tensor) -> torch.Tensor:
        return self.form.compute_bytes(held[: self.nbytes])


@dataclass(frozen=True)
class StoreStats:
    """What a store reports of itself; the backend sums these, counting each store once."""

    host_bytes: int = 0  # host bytes kept beside the blocks' own (`StoredBlock.host_bytes`): the disk tier's pool
    pinned_host_bytes: int = 0
    bytes_read_from_files: int = 0
    disk_bytes_read: int = 0
    disk_stall_seconds: float = 0.0
    host_pool_bytes: int = 0
    disk_staging_bytes: int = 0
    lossless_stored_bytes: int = 0
    lossless_decoded_bytes: int = 0
    """Of the blocks in the lossless form, coded and decoded (see `OffloadStats` for every figure)."""

    @classmethod
    def of_forms(cls, forms: Iterable[StoredForm], **figures) -> StoreStats:
        """`figures`, with the lossless figures of the blocks held in `forms` (those that are coded)."""
        coded = [form for form in forms if form.coded]
        stored, decoded = sum(f.stored_nbytes for f in coded), sum(f.layout.nbytes for f in coded)
        return cls(lossless_stored_bytes=stored, lossless_decoded_bytes=decoded, **figures)

    def __add__(self, other: StoreStats) -> StoreStats:
        return StoreStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class StoredBlockBase:
    """Defaults of the optional parts of `StoredBlock`."""

    @property
    def path(self) -> str:
        return self.layout.path

    copy_waits_on_host = False  # the bytes are in host memory: the job only queues a copy

    def check_lora_(self) -> None:
        pass  # LoRA may change the block (its store keeps it in its own dtype)

    def sync_host_tensors_(self, written: bool) -> None:
        pass  # `host_tensors()` are views of the store's bytes: what was written is there already

    def count_stall_(self, stall_seconds: float) -> None:
        pass  # nothing but the link to wait for

    host_version = None  # writes are not tracked: the store's writers forget the slot copies themselves


class HostStoreBase:
    """Defaults of `HostStore`: a block laid out as it is, no peers, nothing to learn, no figures of its own."""

    def slot_nbytes(self, layout: BlockLayout) -> int:
        return layout.nbytes

    def host_nbytes(self, layout: BlockLayout) -> int:
        return layout.nbytes

    def stored_form(self, layout: BlockLayout) -> StoredForm:
        return PackedForm(layout)

    def disk_part(self, layout: BlockLayout) -> DiskPart:
        return WholePart(self.stored_form(layout))  # this process keeps the whole block

    def place_(self, placement: Placement) -> None:
        pass  # a single-tier store holds every block it is given

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        pass  # nothing to agree on: the store is this process's alone

    def report_failure_(self, error: BaseException) -> None:
        pass  # no peers to tell

    def follow_order_(self, successor: Callable[[str], str | None], num_blocks: int) -> None:
        pass  # nothing read ahead of the slots

    def stats(self) -> StoreStats:
        return StoreStats()


@runtime_checkable
class CopyEngine(Protocol):
    """Moves bytes into device slots beside compute. Per slot: `copy_into(slot, job)` waits until compute released
    it, runs `job`, marks it ready; `wait_ready(slot)` waits for the latest copy (raising `TransferError` for a
    failed job); `release(slot)`: compute is done reading it."""

    kind: str

    def copy_into(self, slot: int, job: Job, record: CopyRecord | None = None, *, waits_on_host: bool = False) -> None:
        """`waits_on_host`: the job may wait on the host (`StoredBlock.copy_waits_on_host`)."""

    def wait_ready(self, slot: int) -> float: ...  # the seconds compute waited on the host (0 on the device)

    def release(self, slot: int) -> None: ...

    def now(self) -> object: ...  # a time mark on the compute side; `resolve` makes it seconds after the run

    def resolve(self, mark: object) -> float: ...

    def copy_records(self) -> list[CopyRecord]: ...  # times resolved (may synchronize: call after a run)

    def clear_records(self) -> None: ...

    def pin_(self, buffer: torch.Tensor) -> bool: ...

    def unpin_(self, buffer: torch.Tensor) -> None: ...

    def capturing(self) -> bool: ...  # the compute stream is being captured into a CUDA graph (never on the CPU)

    def guard_slots_(self, slot_buffers: list[torch.Tensor]) -> None:
        """The slot ring, at enable: its memory may not be handed to anyone else while a copy may still write it."""

    def close(self) -> None:
        """Wait for every copy still in flight, then stop. Host buffers may be freed only after this."""
