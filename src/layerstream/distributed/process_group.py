"""Joining and leaving the process group, and the group offload uses. The group `init_distributed` created is
destroyed at exit where `destroy_distributed()` was not called: left to interpreter shutdown, torch tears it
down while its threads may still run, and the rank aborts (torchrun exit 1).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layerstream.errors import OffloadError

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_ENV = "LAYERSTREAM_COLLECTIVE_TIMEOUT"
DEFAULT_PROCESS_GROUP_TIMEOUT_S = 300.0  # a rank's wait in one collective before it fails (the env var overrides)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for ranks computing on `device`: CUDA gets NCCL plus gloo for the small
    header tensors, checked on the CPU so that the check never waits for the GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"device {device}: layerstream's distributed offload supports CUDA devices and the CPU")


def collective_timeout() -> datetime.timedelta:
    """The collective timeout from ${COLLECTIVE_TIMEOUT_ENV} (seconds), default 300."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not raw:
        return datetime.timedelta(seconds=DEFAULT_PROCESS_GROUP_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV} = {raw!r} is not valid; expected a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


def init_distributed(device: torch.device | str | None = None, *, backend: str | None = None) -> torch.device:
    """Join torchrun's process group (once) and return this rank's device (default ``cuda:LOCAL_RANK``)."""
    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_distributed: the environment lacks {', '.join(missing)}; start the ranks with torchrun "
            "(or `layerstream generate --nproc N`), which sets them"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if dist.is_initialized():
        return device
    backend = backend or backend_for(device)
    _import_group_defaults_first()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=collective_timeout(),
        device_id=device if device.type == "cuda" and "nccl" in backend else None,
    )
    _TEARDOWN.group_created_(dist.group.WORLD)
    logger.info("rank %d of %d joined the process group (%s) on %s", rank, world_size, dist.get_backend(), device)
    return device


def _import_group_defaults_first() -> None:
    """Import `torch.distributed.nn.functional` before the group exists: its functions bind the default group as
    a default argument at first import, and imported later they keep the group alive past
    `destroy_process_group`; its gloo threads then outlive the interpreter and the process aborts."""
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except Exception:  # a build without the RPC parts it imports: nothing binds the group then either
        logger.debug("torch.distributed.nn.functional cannot be imported", exc_info=True)


def destroy_distributed() -> None:
    """Leave the default process group, if this process joined one, after the `before_group_teardown` callbacks.
    Disable every offload handle first: `disable()` is a collective itself."""
    _TEARDOWN.run_callbacks()
    if dist.is_available() and dist.is_initialized():
        _leave_group()
    _TEARDOWN.forget_group()


def before_group_teardown(callback: Callable[[], None]) -> None:
    """Run `callback` (once, newest first; a failure is logged) before the default group is destroyed: it stops
    a thread of its own that issues collectives, so that no thread is inside one when the group goes."""
    _TEARDOWN.add(callback)


class _GroupTeardown:
    """The process's teardown of the group `init_distributed` created, registered with `atexit` once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._group: object | None = None
        self._registered = False

    def group_created_(self, group: object) -> None:
        with self._lock:
            self._group = group
            if not self._registered:
                atexit.register(self.at_exit)
                self._registered = True

    def forget_group(self) -> None:
        with self._lock:
            self._group = None

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks[::-1], []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # teardown goes on: the group must still be destroyed
                logger.warning("a teardown callback failed before leaving the process group", exc_info=True)

    def at_exit(self) -> None:
        """Destroy the group if it is still the one `init_distributed` created (not one the user made since)."""
        self.run_callbacks()
        with self._lock:
            ours, self._group = self._group, None
        if ours is None or not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD is not ours:
            return
        logger.debug("destroying the process group at exit (destroy_distributed() was not called)")
        try:
            _leave_group()
        except Exception:  # at exit there is no caller left to raise to; a peer may be gone already
            logger.warning("destroying the process group at exit failed", exc_info=True)


_TEARDOWN = _GroupTeardown()

LEAVE_BARRIER_TIMEOUT_S = 30.0  # a rank gone or stuck at the leaving barrier is left behind after this


def _leave_group() -> None:
    """Destroy the default group once every rank got here: tearing connections down while a peer finishes its
    last collective makes the peer's gloo threads abort it."""
    try:
        if dist.get_world_size() > 1 and "gloo" in str(dist.get_backend()):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_BARRIER_TIMEOUT_S))
        elif dist.get_world_size() > 1:
            dist.barrier()
    except Exception:  # a peer gone already: leave anyway
        logger.warning("not every rank reached the leaving barrier; leaving the group anyway", exc_info=True)
    dist.destroy_process_group()


@dataclass(frozen=True)
class GroupMembership:
    """This rank's place in the group that offload's collectives run on."""

    group: object  # None: the default group
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where payload all-gathers land

    @property
    def header_device(self) -> torch.device:
        """The CPU where the group has a CPU backend (checking headers never waits for an accelerator)."""
        if self.device.type == "cpu" or "gloo" in self.backend or "mpi" in self.backend:
            return torch.device("cpu")
        return self.device


def join_offload_group(pipeline_class: str, device: torch.device, process_group=None) -> GroupMembership | None:
    """The group `weight_transfer: "allgather"` runs on (`process_group`, else the default), or None for one
    rank. Uninitialized with torchrun's WORLD_SIZE > 1 is an error (each rank would keep a full copy)."""
    prefix = f'{pipeline_class}: weight_transfer "allgather"'
    if not dist.is_available():
        raise OffloadError(f"{prefix} needs torch.distributed, which this torch build lacks; use \"rank-local\"")
    if process_group is None and not dist.is_initialized():
        env_world = os.environ.get("WORLD_SIZE", "1")
        if env_world.isdigit() and int(env_world) > 1:
            raise OffloadError(
                f"{prefix}: WORLD_SIZE={env_world} but torch.distributed is not initialized in this rank; call "
                "layerstream.distributed.init_distributed(device) (or dist.init_process_group) before enable_offload"
            )
        logger.info("%s: torch.distributed is not initialized; one rank, so blocks are copied plainly", prefix)
        return None
    world_size = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise OffloadError(f"{prefix}: this process is not a member of the process_group passed to enable_offload")
    if world_size == 1:
        return None  # a group of one: nothing to gather, so no collective ever runs
    backend = str(dist.get_backend(process_group))
    needed = {"cpu": ("gloo", "mpi"), "cuda": ("nccl", "gloo")}.get(device.type)
    if needed is None:
        raise OffloadError(f"{prefix}: device {device} is not supported; use a CUDA device or the CPU")
    if not any(name in backend for name in needed):
        raise OffloadError(
            f"{prefix}: the process group's backend {backend!r} cannot gather tensors on {device}; use "
            f"{' or '.join(needed)} (init_distributed picks {backend_for(device)!r} for this device)"
        )
    membership = GroupMembership(process_group, rank, world_size, backend, device)
    if membership.header_device != torch.device("cpu"):
        logger.warning(
            "%s: backend %r has no CPU side, so checking each transfer's header waits for the copy stream; "
            "initialize with %r (init_distributed does) to avoid that",
            prefix,
            backend,
            backend_for(device),
        )
    return membership


@dataclass(frozen=True)
class HostShare:
    """How the ranks of the group offload uses share this host's memory (for `host_budget_gb: "auto"`)."""

    world_size: int
    ranks_on_host: int  # LOCAL_WORLD_SIZE; where it is not set, every rank of the group: the share errs low, never high


def offload_host_share(process_group=None) -> HostShare | None:
    """How allgather ranks share this host's memory; None for a group of one. Issues no collective."""
    if not dist.is_available() or (process_group is None and not dist.is_initialized()):
        return None
    world_size = dist.get_world_size(process_group)
    if world_size <= 1:
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks_on_host = min(int(local), world_size) if local.isdigit() and int(local) > 0 else world_size
    return HostShare(world_size, ranks_on_host)
