"""The two interfaces the streamer talks to: where a block's bytes live (`HostStore`) and how they move
(`CopyEngine`).

A host store keeps the bytes of streamed blocks off the device and knows how to put one block into a device
slot: the local packed store (`runtime.packed_store`), the sharded allgather store (`distributed`), and the
low-precision store (`runtime.cast_store`) and the storage tiers to come (checkpoint-backed, disk). A copy engine runs those copies beside compute
with a three-call slot protocol: CUDA streams and events, or a CPU thread with a simulated link
(`runtime.copy_engine`). The streamer (`runtime.streamer`) knows nothing else about either.

Lifecycle of a store, driven by `enable_offload` and the handle:
  `slot_nbytes` (pure, for the placement) -> `check_layouts_` (before anything changes) -> `stage_` per block
  -> `commit_` (every block staged) -> copies through `StoredBlock.copy_job` while enabled -> `restore_` at
  disable (after the engine is closed). A failure before the commit calls `rollback_`, which gives every
  staged block its original tensors back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from layerstream.runtime.layout import BlockLayout, TensorBinder

Job = Callable[[], int]
"""A copy job: moves one block's bytes into a slot and returns how many bytes crossed this process's link."""


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
class StoredBlock(Protocol):
    """One block held by a host store: what the streamer needs to bind it and to copy it into a slot."""

    layout: BlockLayout
    binder: TensorBinder

    @property
    def path(self) -> str: ...

    @property
    def host_bytes(self) -> int:
        """Host bytes this process holds for the block."""

    @property
    def pinned(self) -> bool: ...

    @property
    def link_bytes(self) -> int:
        """Bytes one transfer of the block moves over this process's host link."""

    def copy_job(self, slot_buffer: torch.Tensor) -> Job:
        """A job that fills `slot_buffer` (a whole slot) with the block's packed bytes."""

    def host_range(self, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of the packed block, on the host (for a tensor autograd saved).
        Raises `UnsupportedUseError` where this process does not hold them."""

    def write_back_(self, slot_buffer: torch.Tensor, start: int, end: int) -> int:
        """Copy bytes [start, end) of the packed block from `slot_buffer` back into the store (a buffer the
        block wrote during its forward); returns the bytes written."""

    def host_tensors(self) -> list[torch.Tensor]:
        """One host tensor per layout entry, viewing the store's bytes (`state_dict`, `load_state_dict`), in the
        dtype the store keeps it in. Raises `UnsupportedUseError` where this process does not hold the whole block."""

    # optional: `check_lora_()`, raising `UnsupportedUseError` where LoRA may not change the block (low precision)


@runtime_checkable
class HostStore(Protocol):
    """Keeps streamed blocks' bytes off the device (see the module docstring for the lifecycle)."""

    kind: str
    # optional: `bytes_read_from_files` (int), the bytes staged straight from checkpoint files; and
    # `follow_order_(successor, num_blocks)`, called after the commit with the streamer's prediction of the block
    # that runs after a block (a store that reads ahead of the slots follows it: the disk tier)

    def slot_nbytes(self, layout: BlockLayout) -> int:
        """Bytes the block needs in a device slot (pure; the placement sizes the slots from it)."""

    def check_layouts_(self, layouts: Sequence[BlockLayout], slot_nbytes: int) -> None:
        """Check, before anything changes, that the store can hold these blocks (a collective store checks that
        every rank agrees). Raises `OffloadError`."""

    def report_failure_(self, error: BaseException) -> None:
        """This process failed before or while staging: let any peer know (a local store has none)."""

    def stage_(self, layout: BlockLayout, device: torch.device, pin: Pinner | None) -> StoredBlock:
        """Take the block's bytes into the store; from now on the block may hold placeholders."""

    def commit_(self) -> None:
        """Every block is staged: the store's copy becomes the only one (originals may be dropped)."""

    def rollback_(self) -> None:
        """Undo every `stage_` (before the commit): blocks get their original tensors back, host memory goes."""

    def restore_(self, device: torch.device) -> None:
        """Give every block real tensors on `device` again (fresh storage, same layout) and free the host
        memory. The caller has closed the copy engine first: no copy may still read a host buffer."""


@runtime_checkable
class CopyEngine(Protocol):
    """Moves bytes into device slots beside compute. For each slot:

    - `copy_into(slot, job)`: on the copy side, wait until compute has released the slot, run `job`, then
      mark the slot ready;
    - `wait_ready(slot)`: compute waits until the slot's latest copy is done (a failed job raises
      `TransferError` here);
    - `release(slot)`: compute marks that it is done reading the slot.
    """

    kind: str

    def copy_into(self, slot: int, job: Job, record: CopyRecord | None = None) -> None: ...

    def wait_ready(self, slot: int) -> float:
        """Returns the seconds compute waited on the host (0 where it waits on the device)."""

    def release(self, slot: int) -> None: ...

    def now(self) -> object:
        """A time mark on the compute side; `resolve` turns it into seconds after the run."""

    def resolve(self, mark: object) -> float: ...

    def copy_records(self) -> list[CopyRecord]:
        """Every recorded copy with its times resolved (may synchronize: call after a run)."""

    def clear_records(self) -> None: ...

    def pin_(self, buffer: torch.Tensor) -> bool: ...

    def unpin_(self, buffer: torch.Tensor) -> None: ...

    def close(self) -> None:
        """Wait for every copy still in flight, then stop. Host buffers may be freed only after this."""
