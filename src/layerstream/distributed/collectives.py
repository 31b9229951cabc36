"""`BlockGather`: the collectives of `weight_transfer: "allgather"`, in one order on every rank (a layout vote and
a commit vote at enable; per transfer, a header all-gather then the payload). A rank's transfers depend only on
the blocks it runs, never timing, so ranks running the same blocks issue the same collectives; where headers
disagree every rank raises `TransferError` without the payload (whose sizes could differ and hang the group).
After a collective errors (a peer died, the timeout expired) no further collective is issued at all.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

import layerstream.distributed.process_group as groups
from layerstream.distributed.process_group import GroupMembership
from layerstream.errors import OffloadError, TransferError
from layerstream.runtime.contracts import StoredForm
from layerstream.runtime.packing.layout import ALIGN_BYTES, align_up

logger = logging.getLogger(__name__)

_MAGIC = 0x4C53_4147  # "LSAG": a header from layerstream, not from another collective on the same group
_PREFETCH, _RESTORE = 1, 2
_KIND_NAMES = {_PREFETCH: "transfer", _RESTORE: "restore"}
_VOTE_LAYOUTS, _VOTE_COMMIT = 11, 12
_VOTE_LEN = 9  # both votes gather rows of one length, so a rank at the other vote is reported, not a size error
_OK, _FAILED = 1, 0


def shard_nbytes(nbytes: int, world_size: int) -> int:
    """Bytes of one rank's shard: ceil(nbytes / N), aligned so that every chunk of a slot starts aligned."""
    return align_up(-(-nbytes // world_size), ALIGN_BYTES)


def layout_digest(forms: Sequence[StoredForm], slot_nbytes: int, world_size: int) -> bytes:
    """sha256 of what the ranks must agree on before their first payload: each block's layout and form."""
    h = hashlib.sha256()
    h.update(f"world={world_size};slot={slot_nbytes};blocks={len(forms)}\n".encode())
    for form in forms:
        layout = form.layout
        stored = form.stored_nbytes
        h.update(f"block {layout.path} nbytes={layout.nbytes} {form.signature} shard={shard_nbytes(stored, world_size)}\n".encode())
        for e in layout.entries:
            h.update(f"  {e.name} {e.is_param} {e.dtype} {e.shape} {e.stride} {e.element_offset} {e.span_index}\n".encode())
    return h.digest()


class BlockGather:
    """The group's collectives for one offload handle (see the module docstring for order and failures)."""

    def __init__(self, pipeline_class: str, membership: GroupMembership):
        self.pipeline_class = pipeline_class
        self.membership = membership
        self.rank = membership.rank
        self.world_size = membership.world_size
        self.block_paths: list[str] = []  # every sharded block's path, by the index its headers carry
        self._lock = threading.Lock()
        self._sequence = 0
        self._layout_tag = 0
        self._failure: str | None = None
        self._consistent_failure = False
        self._committed = False

    def __repr__(self) -> str:
        state = "ok" if self._failure is None else ("failed (consistent)" if self._consistent_failure else "failed")
        return f"BlockGather(rank {self.rank} of {self.world_size}, {self.membership.backend}, {len(self.block_paths)} blocks, {state})"

    def shard_nbytes(self, nbytes: int) -> int:
        return shard_nbytes(nbytes, self.world_size)

    def close_(self, reason: str = "the process group is being destroyed") -> None:
        """Issue no collective from now on (after the one in flight, which the peers issue too)."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
                self._consistent_failure = False

    def register_block(self, path: str) -> int:
        """The index headers carry for this block (the same on every rank: layouts are registered in order)."""
        self.block_paths.append(path)
        return len(self.block_paths) - 1

    # --- enable: the two votes ------------------------------------------------------------------------------
    def agree_on_layouts_(
        self, forms: Sequence[StoredForm] = (), slot_nbytes: int = 0, failure: BaseException | None = None
    ) -> None:
        """Check that every rank computed the same layouts in the same forms; raise `OffloadError` on every rank
        if not. A rank whose own checks failed still votes, so that the others raise at once, not at the timeout."""
        digest = layout_digest(forms, slot_nbytes, self.world_size)
        self._layout_tag = int.from_bytes(digest[:7], "little")  # 56 bits: fits an int64 header field
        words = [int.from_bytes(digest[i : i + 7], "little") for i in range(0, 28, 7)]
        local = [_VOTE_LAYOUTS, _OK if failure is None else _FAILED, len(forms), sum(f.stored_nbytes for f in forms), slot_nbytes, *words]
        rows = self._vote(local, "comparing block layouts")
        if failure is not None:
            return
        failed = [r for r, row in enumerate(rows) if row[1] != _OK]
        if failed:
            raise OffloadError(
                f"{self._prefix()}: rank(s) {_ranks(failed)} could not enable offload (see their error); nothing "
                "was changed on any rank"
            )
        if any(row != rows[0] for row in rows):
            digests = ["".join(w.to_bytes(7, "little").hex() for w in row[5:])[:12] for row in rows]
            described = "; ".join(
                f"rank {r}: {row[2]} sharded blocks, {row[3]} bytes, slot {row[4]} bytes, digest {digests[r]}"
                for r, row in enumerate(rows)
            )
            raise OffloadError(
                f"{self._prefix()}: the ranks built different block layouts ({described}). Every rank must load "
                "the same model with the same config (and, with resident_layers \"auto\", the same "
                "device_budget_gb); nothing was changed on any rank"
            )

    def commit_(self, failure: BaseException | None = None) -> None:
        """The last vote of enable (only the first call votes): where any rank failed, every rank rolls back."""
        if self._committed:
            return
        self._committed = True
        rows = self._vote([_VOTE_COMMIT, _OK if failure is None else _FAILED], "committing")
        failed = [r for r, row in enumerate(rows) if row[1] != _OK]
        if failure is None and failed:
            raise OffloadError(
                f"{self._prefix()}: rank(s) {_ranks(failed)} failed while enabling offload (see their error); "
                "rolled back on every rank"
            )

    def _vote(self, local: list[int], what: str) -> list[list[int]]:
        local = local + [0] * (_VOTE_LEN - len(local))
        try:
            with self._lock:
                rows = self._all_gather_ints(local)
        except Exception as e:
            raise OffloadError(f"{self._prefix()}: {what} with the other ranks failed: {e}") from e
        for r, row in enumerate(rows):
            if row[0] != local[0]:
                raise OffloadError(
                    f"{self._prefix()}: rank {r} was at another step of enable_offload while this rank was "
                    f"{what} (another collective on the same group interleaved)"
                )
        return rows

    # --- transfers ------------------------------------------------------------------------------------------
    def gather_block_(self, index: int, nbytes: int, shard: torch.Tensor, gathered: torch.Tensor) -> None:
        """Fill `gathered` (world_size chunks) with block `index`: this rank's `shard` crosses the host link."""
        with self._lock:
            self._gather_(_PREFETCH, index, nbytes, shard, gathered, non_blocking=True)

    def gather_full_(self, index: int, nbytes: int, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of block `index`, concatenated, on the compute device (for disable)."""
        if not self._lock.acquire(blocking=False):
            raise TransferError(
                f"{self._prefix()}: cannot restore {self.block_paths[index]}: a transfer of this rank is still "
                "waiting for the other ranks; the full weights cannot be gathered"
            )
        try:
            out = torch.empty(self.world_size * shard.numel(), dtype=torch.uint8, device=self.membership.device)
            self._gather_(_RESTORE, index, nbytes, shard, out, non_blocking=False)
            return out
        finally:
            self._lock.release()

    def _gather_(self, kind: int, index: int, nbytes: int, shard: torch.Tensor, out: torch.Tensor, non_blocking: bool):
        self._check_usable(kind, index)
        self._agree_on_header(kind, index, nbytes)
        chunk = shard.numel()
        out[self.rank * chunk : (self.rank + 1) * chunk].copy_(shard, non_blocking=non_blocking)
        self._all_gather_payload(out, chunk, index)

    def _check_usable(self, kind: int, index: int) -> None:
        if self._failure is None or (kind == _RESTORE and self._consistent_failure):
            return
        raise TransferError(
            f"{self._prefix()}: no {_KIND_NAMES[kind]} of {self.block_paths[index]}: the allgather transfer failed "
            f"earlier ({self._failure})"
            + ("" if self._consistent_failure else "; restart every rank (full weights exist on no rank alone)")
        )

    def _agree_on_header(self, kind: int, index: int, nbytes: int) -> None:
        self._sequence += 1
        local = [_MAGIC, self._layout_tag, self._sequence, kind, index, nbytes]
        try:
            rows = self._all_gather_ints(local)
        except Exception as e:
            raise self._fail(f"{_KIND_NAMES[kind]} #{self._sequence} of {self.block_paths[index]}: {e}", e) from e
        if all(row == local for row in rows):
            return
        asked = "; ".join(f"rank {r} {self._describe(row)}" for r, row in enumerate(rows))
        self._failure = f"ranks disagree on {_KIND_NAMES[kind]} #{self._sequence}: {asked}"
        self._consistent_failure = True  # every rank saw these same headers and stops here too
        raise TransferError(
            f"{self._prefix()}: {self._failure}. Data-parallel ranks must run the same blocks in the same order "
            "(the same pipeline, shapes and step count); no rank transferred anything for it"
        )

    def _describe(self, row: list[int]) -> str:
        magic, tag, sequence, kind, index, _ = row
        if magic != _MAGIC:
            return "sent something that is not a layerstream header (another collective on the same group?)"
        if tag != self._layout_tag:
            return f"is at #{sequence} of a gather with other block layouts (another offload handle?)"
        name = self.block_paths[index] if 0 <= index < len(self.block_paths) else f"block #{index}"
        return f"is at #{sequence}: {_KIND_NAMES.get(kind, kind)} of {name}"

    def _all_gather_payload(self, gathered: torch.Tensor, chunk: int, index: int) -> None:
        group = self.membership.group
        try:
            if gathered.device.type == "cuda" and "nccl" in self.membership.backend:
                # one in-place all-gather into the slot. NCCL runs it after the work queued on the current
                # (copy) stream, and the copy stream waits for it: the slot's ready event follows the gather
                own = gathered[self.rank * chunk : (self.rank + 1) * chunk]
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name
                gather(gathered[: self.world_size * chunk], own, group=group)
            else:
                # gloo gathers into a list of views; each rank's own chunk is both input and output. On CUDA
                # tensors gloo orders itself after the current stream and makes it wait, as NCCL does
                chunks = list(gathered[: self.world_size * chunk].split(chunk))
                dist.all_gather(chunks, chunks[self.rank], group=group)
        except Exception as e:
            raise self._fail(f"all-gather of {self.block_paths[index]}: {e}", e) from e

    def _fail(self, message: str, error: BaseException) -> TransferError:
        self._failure = message
        self._consistent_failure = False
        logger.debug("allgather transfer failed on rank %d", self.rank, exc_info=error)
        return TransferError(
            f"{self._prefix()}: {message}. A peer rank failed, exited or stopped issuing transfers; no further "
            "collective is issued by this rank"
        )

    def _all_gather_ints(self, values: list[int]) -> list[list[int]]:
        device = self.membership.header_device
        local = torch.tensor(values, dtype=torch.int64, device=device)
        out = torch.empty(self.world_size, len(values), dtype=torch.int64, device=device)
        dist.all_gather(list(out.unbind(0)), local, group=self.membership.group)
        # on an accelerator this reads the result back, waiting for the gather (only groups without a CPU side)
        return out.tolist()

    def _prefix(self) -> str:
        return f'{self.pipeline_class}: weight_transfer "allgather" (rank {self.rank} of {self.world_size})'


def open_block_gather(pipeline_class: str, device: torch.device, process_group=None) -> BlockGather | None:
    """A `BlockGather` on the group offload uses, or None for a group of one (plain copies, no collective)."""
    membership = groups.join_offload_group(pipeline_class, device, process_group)
    if membership is None:
        return None
    gather = BlockGather(pipeline_class, membership)
    # a handle still enabled when the group goes (destroy_distributed, or the exit teardown): its copy thread
    # must not be inside, or start, a collective on a destroyed group (that aborts the process)
    alive = weakref.ref(gather)
    groups.before_group_teardown(lambda: (lambda g: g is not None and g.close_())(alive()))
    return gather


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)

