"""Serving on several ranks: how they talk, and what every rank runs in a wave. A process group must see its collectives
in one order on every rank, so the ranks talk three ways: the default group at the start alone; torchrun's key-value
store for messages, outcomes, heartbeats and stop points (`ControlChannel`: a rank that finished first waits without a
timeout); and the offload group for allgather, replaced after a failed wave. What crosses the store is pickled: whoever
reaches its port runs code on every rank, as with torch.distributed itself (docs/several-gpus.md says how to keep it
private). Every key a wave writes is deleted once every rank has read it; the heartbeats and the last message end with
the store."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch

from layerstream.errors import LayerstreamError
from layerstream.models.input_image import ImageFile, image_file
from layerstream.request import GenerationError, GenerationRequest
from layerstream.server.output_loop import GroupWork, RequestResult, run_group
from layerstream.server.served import StepObserver
from layerstream.server.stopping import GenerationStopped, StopReason
from layerstream.wording import first_line

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
WAIT_LOG_S = 30.0
STOP_LAG_CHECKPOINTS = 2  # ahead of rank 0: ranks that share blocks run at most a few blocks apart


class RankGroupError(LayerstreamError, RuntimeError):
    """A rank is gone or stopped answering within the collective timeout: no further wave can run."""


class WaveKind(StrEnum):
    RUN = "run"  # run `works[rank]` and report
    PING = "ping"  # report (host bytes): an idle group notices a lost rank and never times out
    RECOVER = "recover"  # the last wave failed: rebuild the runtime on a fresh offload group, then report
    STOP = "stop"  # leave the loop: the server is stopping


@dataclass(frozen=True)
class WaveMessage:
    kind: WaveKind
    wave_id: int = 0
    works: tuple[GroupWork, ...] = ()

    def with_image_files(self) -> WaveMessage:
        """This message with every input image as an `ImageFile` (a decoded picture encoded once as PNG)."""
        files: dict[int, ImageFile] = {}  # a placeholder shares its image with the work it copies: one file

        def carried(request: GenerationRequest) -> GenerationRequest:
            if request.image is None or isinstance(request.image, ImageFile):
                return request
            if id(request.image) not in files:
                files[id(request.image)] = image_file(request.image)
            return replace(request, image=files[id(request.image)])

        works = tuple(replace(work, requests=tuple(map(carried, work.requests))) for work in self.works)
        return replace(self, works=works)


@dataclass
class RankOutcome:  # what a rank reports after each message
    rank: int
    host_bytes: int | None
    error: str | None = None  # one line, when the rank's work raised (anything but a requested stop)
    refused: bool = False  # the error was the pipeline refusing the arguments: no forward ran
    stopped: StopReason | None = None
    results: list[RequestResult] = field(default_factory=list)
    num_placeholder_steps: int = 0


@dataclass(frozen=True)
class RankSetup:
    """This rank's place among the serving ranks; built by `join_serving_ranks`."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta  # how long a rank may be silent (or a transfer wait) before it counts as lost
    store: Any  # every rank reaches it: messages, outcomes, heartbeats and stop points


def join_serving_ranks(device: str | None, timeout_s: float, prepare: Callable[[], None]) -> RankSetup:
    """Join torchrun's group; `prepare` runs on rank 0 before the others go on (a model built once, not N times)."""
    import torch.distributed as dist

    from layerstream.distributed.process_group import COLLECTIVE_TIMEOUT_ENV, init_distributed

    os.environ[COLLECTIVE_TIMEOUT_ENV] = repr(float(timeout_s))  # init_distributed reads it
    compute_device = init_distributed(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        prepare()
    dist.barrier()  # the others wait for rank 0's preparation
    timeout = datetime.timedelta(seconds=timeout_s)
    # a client of its own on torchrun's store: waits here never hold a connection another thread needs
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    # one namespace per run and per torchrun restart: a restarted group must not read its predecessor's keys
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(f"layerstream-serve/{run}/", client)
    return RankSetup(rank, world_size, compute_device, str(dist.get_backend()), timeout, store)


class ControlChannel:
    """Rank 0's messages to every rank, and every rank's outcome back, through the store. Liveness comes from
    heartbeats: a rank waiting on another gives up (`RankGroupError`) once that rank's counter has not moved
    for the collective timeout."""

    def __init__(self, setup: RankSetup):
        self.setup = setup
        self._sequence = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat count, when it last changed)
        self._stopped = threading.Event()
        # the first beat before the thread's: a rank's counter is in the store from the moment its channel is
        self._store_call(setup.store.add, f"heartbeat/{setup.rank}", 1)
        self._heart = threading.Thread(target=self._beat, name="layerstream-heartbeat", daemon=True)
        self._heart.start()

    def wait_for_ranks(self) -> None:
        """Rank 0, before it answers HTTP: wait until every other rank has loaded its model and opened its channel."""
        started = time.monotonic()
        logged = started
        for peer in range(1, self.setup.world_size):
            while not self._store_call(self.setup.store.check, [f"heartbeat/{peer}"]):
                if time.monotonic() - logged > WAIT_LOG_S:
                    logged = time.monotonic()
                    logger.info("waiting for rank %d to load its model (%.0f s)", peer, logged - started)
                time.sleep(HEARTBEAT_S)  # a model load takes seconds to minutes: no need to ask the store more often

    def close(self) -> None:
        self._stopped.set()
        self._heart.join(HEARTBEAT_S * 4)

    def broadcast(self, message: WaveMessage | None) -> WaveMessage:
        """Rank 0: send `message` to every rank. The others: wait for rank 0's next message."""
        self._sequence += 1
        key = f"message/{self._sequence}"
        if self.setup.rank == 0:
            self._store_call(self.setup.store.set, key, pickle.dumps(message))
            return message
        self._wait_for(key, peer=0)
        return pickle.loads(self._store_call(self.setup.store.get, key))

    def gather(self, outcome: RankOutcome) -> list[RankOutcome] | None:
        """Every rank's outcome of the last message, on rank 0 (in rank order); None on the others."""
        store, rank = self.setup.store, self.setup.rank
        if rank != 0:
            self._store_call(store.set, f"outcome/{self._sequence}/{rank}", pickle.dumps(outcome))
            return None
        outcomes = [outcome]
        for peer in range(1, self.setup.world_size):
            key = f"outcome/{self._sequence}/{peer}"
            self._wait_for(key, peer=peer)
            outcomes.append(pickle.loads(self._store_call(store.get, key)))
            self._store_call(store.delete_key, key)
        self._store_call(store.delete_key, f"message/{self._sequence}")  # every rank has read it
        return outcomes

    def check_alive(self) -> None:
        for peer in range(self.setup.world_size):
            if peer != self.setup.rank:
                self._check_peer(peer)

    def _wait_for(self, key: str, *, peer: int) -> None:
        """Block until `key` is in the store, checking `peer`'s heartbeat once per collective timeout."""
        from torch.distributed import DistStoreError

        self._check_peer(peer)  # its beat count now: a silence is measured from here
        while True:
            try:
                self.setup.store.wait([key], self.setup.timeout)
                return
            except DistStoreError:  # the wait timed out: the key is not there yet
                pass
            except Exception as e:  # the store's host (torchrun, or rank 0) is gone
                raise RankGroupError(f"the serving ranks lost their store: {first_line(e)}") from e
            self._check_peer(peer)

    def _check_peer(self, peer: int) -> None:
        count = self._store_call(self.setup.store.add, f"heartbeat/{peer}", 0)
        now, timeout = time.monotonic(), self.setup.timeout.total_seconds()
        last = self._seen.get(peer)
        if last is None or last[0] != count:
            self._seen[peer] = (count, now)
        elif now - last[1] > timeout:
            silence = f"rank {peer} has not answered for {now - last[1]:.1f} s"
            raise RankGroupError(f"{silence} (the collective timeout is {timeout:g} s): it exited or hangs")

    def _beat(self) -> None:
        # several beats per timeout, however short the timeout: a live rank is never taken for a lost one
        interval = min(HEARTBEAT_S, self.setup.timeout.total_seconds() / 4)
        while not self._stopped.wait(interval):
            try:
                self.setup.store.add(f"heartbeat/{self.setup.rank}", 1)
            except Exception:  # the store is gone: the peers notice our silence
                return

    @staticmethod
    def _store_call(function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as e:  # the store's host (torchrun, or rank 0) is gone
            raise RankGroupError(f"the serving ranks lost their store: {first_line(e)}") from e


class WaveStop:
    """Checkpoints of one wave on one rank: where every rank stops, once rank 0 has decided to stop it. No
    collective: rank 0 writes ``stop/{wave}`` a few checkpoints (`STOP_LAG_CHECKPOINTS`) ahead of its own, and every
    rank stops at that checkpoint, so all run the same forwards."""

    def __init__(self, store: Any, wave_id: int, decide: Callable[[], StopReason | None] | None = None):
        self._store = store
        self._key = f"stop/{wave_id}"
        self._decide = decide
        self._count = 0
        self._target: tuple[int, StopReason] | None = None

    def checkpoint(self, where: str) -> None:
        """Called at the same points on every rank; raises `GenerationStopped` at the stop point."""
        self._count += 1
        if self._target is None:
            if self._decide is not None:  # rank 0: the only rank that knows about clients and deadlines
                reason = self._decide()
                if reason is not None:
                    self._target = (self._count + STOP_LAG_CHECKPOINTS, reason)
                    self._store.set(self._key, f"{self._target[0]} {reason}")
            elif self._store.check([self._key]):
                at, reason = self._store.get(self._key).decode().split()
                self._target = (int(at), StopReason(reason))
        if self._target is not None and self._count >= self._target[0]:
            reason = self._target[1]
            raise GenerationStopped(reason, f"generation stopped ({reason}) {where}")

    def forget(self) -> None:
        """Rank 0, once every rank has reported the wave: its stop point, if any, leaves the store."""
        if self._decide is not None and self._target is not None:
            self._store.delete_key(self._key)


class RankRuntime:
    """This rank's `Omni`, loaded on an offload group of the ranks, and the work of a wave run on it."""

    def __init__(self, setup: RankSetup, load: Callable[[Any], Any]):
        # `load(process_group)` builds the `Omni` on every rank at once: enabling allgather is a collective
        self.setup = setup
        self._load = load
        self._group = self._new_offload_group()
        self.omni = load(self._group)

    def _new_offload_group(self) -> Any:
        import torch.distributed as dist

        from layerstream.distributed.process_group import backend_for

        return dist.new_group(backend=backend_for(self.setup.device), timeout=self.setup.timeout)

    def host_bytes(self) -> int | None:
        stats = self.omni.stats()
        return stats.host_bytes if stats is not None else None

    def rebuild(self) -> None:
        """A fresh `Omni` on a fresh offload group, on every rank together (after a wave that failed). The old
        group is destroyed first: giving its blocks back is a collective a failed rank would leave unmatched."""
        import torch.distributed as dist

        old_omni, old_group = self.omni, self._group
        self.omni = None
        try:
            dist.destroy_process_group(old_group)
        except Exception:
            logger.warning("destroying the failed wave's offload group failed", exc_info=True)
        try:  # stops its copy thread; giving the blocks back fails at once, on a group that is gone
            old_omni.close()
        except Exception as e:
            logger.info("rank %d: the failed runtime could not give its blocks back (%s); dropped", self.setup.rank, e)
        del old_omni
        gc.collect()  # the old host store is freed before the new one is filled
        self._group = self._new_offload_group()
        self.omni = self._load(self._group)
        logger.info("rank %d: runtime rebuilt after a failed wave", self.setup.rank)

    def run(self, message: WaveMessage, stop: WaveStop, observer: StepObserver | None = None) -> RankOutcome:
        """Run this rank's work of `message`; a failure is reported, not raised (the group must still meet)."""
        work = message.works[self.setup.rank]
        outcome = RankOutcome(self.setup.rank, None)
        try:
            outcome.results = run_group(self.omni, work, stop.checkpoint, observer=observer)
        except GenerationStopped as e:
            outcome.stopped = e.reason
            logger.info("rank %d: %s", self.setup.rank, e)
        except GenerationError as e:  # the same on every rank: the arguments, not the runtime
            outcome.error, outcome.refused = str(e), True
            logger.info("rank %d: generation refused: %s", self.setup.rank, e)
        except Exception as e:
            outcome.error = first_line(e, with_type=True)
            logger.exception("rank %d: generation of wave %d failed", self.setup.rank, message.wave_id)
        if work.placeholder:
            outcome.num_placeholder_steps = sum(len(run.step_seconds) for r in outcome.results for run in r.runs)
            outcome.results = []  # an idle rank's outputs are nobody's
        outcome.host_bytes = self.host_bytes()
        return outcome

    @property
    def shares_weights(self) -> bool:
        """Whether a component uses allgather: then a failed wave leaves the ranks' transfers out of step."""
        layer_options = self.omni.config.to_dict().get("layer_options", {})
        return any(options.get("weight_transfer") == "allgather" for options in layer_options.values())


def lead_wave(
    channel: ControlChannel, runtime: RankRuntime, message: WaveMessage, decide: Callable[[], StopReason | None],
    observer: StepObserver | None = None,
) -> list[RankOutcome]:
    """Rank 0's side of a RUN wave: send `message`, run its share, gather; `decide` says when to stop it."""
    message = message.with_image_files()
    channel.broadcast(message)
    stop = WaveStop(channel.setup.store, message.wave_id, decide=decide)
    outcomes = channel.gather(runtime.run(message, stop, observer))
    stop.forget()  # every rank has reported: nothing reads the wave's stop point any more
    assert outcomes is not None  # rank 0 gathers
    return outcomes


def serve_follower(runtime: RankRuntime, channel: ControlChannel) -> None:
    """A rank other than 0: run every wave rank 0 sends until it says stop; `RankGroupError` if rank 0 is lost."""
    rank = runtime.setup.rank
    while True:
        message = channel.broadcast(None)
        if message.kind is WaveKind.STOP:
            logger.info("rank %d: stop received", rank)
            return
        if message.kind is WaveKind.RUN:
            outcome = runtime.run(message, WaveStop(runtime.setup.store, message.wave_id))
        else:
            if message.kind is WaveKind.RECOVER:
                runtime.rebuild()
            outcome = RankOutcome(rank, runtime.host_bytes())
        channel.gather(outcome)
