"""A wave's exchange through a real TCPStore on loopback, with rank 0 and rank 1 as threads of this process (no
process group, no model; a runtime that decodes its input images as a pipeline run does): what crosses is the
file a user sent, each rank decodes it to the picture rank 0 would run, and every key a wave writes has left
the store once the wave is done."""

from __future__ import annotations

import datetime
import io
import threading
import time

import numpy as np
import pytest
import torch

from layerstream.models.input_image import ImageFile, read_image_file, read_input_image
from layerstream.request import GenerationRequest
from layerstream.server.output_loop import GroupWork, RequestResult
from layerstream.server.ranks import (
    ControlChannel, RankOutcome, RankSetup, WaveKind, WaveMessage, lead_wave, serve_follower,
)  # fmt: skip
from layerstream.server.stopping import GenerationStopped, StopReason

NUM_CHECKPOINTS = 4
"""Per request, as a run's denoising steps would be."""


class _RecordingStore:
    """A rank's store, recording the size of every value it sets (and the messages themselves)."""

    def __init__(self, store):
        self._store = store
        self.sizes: dict[str, int] = {}
        self.messages: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.sizes[key] = len(value)
        if key.startswith("message/"):
            self.messages[key] = bytes(value)
        self._store.set(key, value)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class _DecodingRuntime:
    """A rank's runtime for the followers' loop and `lead_wave`: each request of its share decodes its input
    image as a pipeline run does (`read_input_image`), then passes its checkpoints. Rank 1 starts its
    checkpoints once rank 0 has run its own: a stop point rank 0 sets is then there to read."""

    def __init__(self, setup: RankSetup, rank0_ran: threading.Semaphore):
        self.setup = setup
        self.rank0_ran = rank0_ran
        self.messages: list[WaveMessage] = []
        self.pictures: list[np.ndarray] = []

    def run(self, message: WaveMessage, stop, observer=None) -> RankOutcome:
        self.messages.append(message)
        outcome = RankOutcome(self.setup.rank, 0)
        try:
            if self.setup.rank != 0:
                assert self.rank0_ran.acquire(timeout=30)
            for request in message.works[self.setup.rank].requests:
                self.pictures.append(np.asarray(read_input_image(request.image)))
                for step in range(NUM_CHECKPOINTS):
                    stop.checkpoint(f"step {step}")
                outcome.results.append(RequestResult(files=[b"an encoded output"]))
        except GenerationStopped as e:
            outcome.stopped = e.reason
        finally:
            if self.setup.rank == 0:
                self.rank0_ran.release()
        return outcome

    def host_bytes(self) -> int:
        return 0


def _jpeg(width: int, height: int, orientation: int) -> bytes:
    """A smooth picture, as a phone stores it (turned by its EXIF tag): compresses far below its pixels."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    image = Image.fromarray(pixels.astype(np.uint8))
    exif = image.getexif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


@pytest.fixture
def two_ranks():
    """(the master store, rank 0's channel, both ranks' runtimes), rank 1 running `serve_follower` on a thread
    until rank 0 tells it to leave; each rank a client of its own under a run's prefix, as `join_serving_ranks`
    makes them."""
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=10)
    rank0_ran = threading.Semaphore(0)
    setups, channels = [], []
    for rank in range(2):
        client = torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timeout)
        store = _RecordingStore(torch.distributed.PrefixStore("layerstream-serve/test/0/", client))
        setups.append(RankSetup(rank, 2, torch.device("cpu"), "gloo", timeout, store))
        channels.append(ControlChannel(setups[-1]))
    runtimes = [_DecodingRuntime(setup, rank0_ran) for setup in setups]
    follower = threading.Thread(target=serve_follower, args=(runtimes[1], channels[1]), daemon=True)
    follower.start()
    try:
        yield master, channels[0], runtimes
        channels[0].broadcast(WaveMessage(WaveKind.STOP))
        follower.join(10)
        assert not follower.is_alive()
    finally:
        for channel in channels:
            channel.close()


def test_a_wave_sends_the_uploaded_file_and_leaves_no_key_behind(two_ranks):
    from PIL import Image

    master, channel, (rank0, rank1) = two_ranks
    upload = _jpeg(1024, 768, orientation=6)  # a phone photo, stored on its side
    decoded_bytes = 1024 * 768 * 3
    small_photo = _jpeg(32, 16, orientation=8)
    works = (  # rank 0's image exists only decoded (a PIL image); rank 1's is the upload, as the server keeps it
        GroupWork((GenerationRequest(prompt="p", image=Image.open(io.BytesIO(small_photo))),), batch_call=False),
        GroupWork((GenerationRequest(prompt="q", image=read_image_file(upload)),), batch_call=False),
    )
    store = channel.setup.store
    deadline = time.monotonic() + 10  # each rank's heartbeat counter: for the group's life, not the wave's
    while not store.check(["heartbeat/0", "heartbeat/1"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    num_keys = master.num_keys()

    outcomes = lead_wave(channel, rank0, WaveMessage(WaveKind.RUN, 1, works), decide=lambda: None)
    assert [o.results[0].files for o in outcomes] == [[b"an encoded output"]] * 2
    assert master.num_keys() == num_keys  # the message, rank 1's outcome: gone
    # rank 1 ran what rank 0 sent and ran, its image the upload itself, decoded upright as in one process
    assert rank1.messages == rank0.messages
    assert rank1.messages[0].works[1].requests[0].image == ImageFile(upload, (768, 1024))
    assert np.array_equal(rank1.pictures[0], np.asarray(read_input_image(upload)))
    # rank 0's decoded picture crossed once as a PNG, and decodes there to what it was
    assert rank1.messages[0].works[0].requests[0].image.data.startswith(b"\x89PNG")
    assert np.array_equal(rank0.pictures[0], np.asarray(read_input_image(works[0].requests[0].image)))
    assert upload in store.messages["message/1"]  # the file's bytes, as sent
    assert store.sizes["message/1"] < len(upload) + 16_384 < decoded_bytes // 10, (len(upload), store.sizes)

    # a wave rank 0 stops: every rank stops at the stop point, and the key that held it is gone too
    outcomes = lead_wave(channel, rank0, WaveMessage(WaveKind.RUN, 2, works), decide=lambda: StopReason.TIMEOUT)
    assert [o.stopped for o in outcomes] == [StopReason.TIMEOUT] * 2
    assert "stop/2" in store.sizes and master.num_keys() == num_keys


class _CountingStore:
    """A rank's store, counting the calls made to it while `counting` is set (checks and waits: how a rank looks
    for a key)."""

    def __init__(self, store):
        self._store = store
        self.counting = False
        self.calls: dict[str, int] = {"check": 0, "wait": 0}

    def check(self, keys):
        self.calls["check"] += self.counting
        return self._store.check(keys)

    def wait(self, keys, timeout):
        self.calls["wait"] += self.counting
        return self._store.wait(keys, timeout)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def _channels(timeout_s: float):
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=timeout_s)
    channels = []
    for rank in range(2):
        client = torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timeout)
        store = _CountingStore(torch.distributed.PrefixStore("layerstream-serve/test/0/", client))
        channels.append(ControlChannel(RankSetup(rank, 2, torch.device("cpu"), "gloo", timeout, store)))
    return master, channels


def test_a_follower_blocks_on_the_store_until_the_message_comes():
    """Waiting for rank 0's next message is one wait on the store, woken by the key, not a poll every few ms
    (a check every 5 ms made some 200 calls in this second)."""
    master, (rank0, rank1) = _channels(timeout_s=30)
    received = []
    follower = threading.Thread(target=lambda: received.append(rank1.broadcast(None)), daemon=True)
    try:
        rank1.setup.store.counting = True
        follower.start()
        time.sleep(1.0)  # the follower waits: nothing is sent yet
        assert follower.is_alive() and received == []
        rank0.broadcast(WaveMessage(WaveKind.PING))
        follower.join(30)
        assert [m.kind for m in received] == [WaveKind.PING]  # woken by the key
        assert rank1.setup.store.calls == {"check": 0, "wait": 1}, rank1.setup.store.calls
    finally:
        rank0.close()
        rank1.close()


def test_a_follower_waiting_on_a_silent_rank_0_gives_up_after_the_collective_timeout():
    from layerstream.server.ranks import RankGroupError

    master, (rank0, rank1) = _channels(timeout_s=1.0)
    try:
        rank0.close()  # its heartbeat stops; it sends nothing
        with pytest.raises(RankGroupError, match="rank 0 has not answered"):
            rank1.broadcast(None)
    finally:
        rank1.close()
