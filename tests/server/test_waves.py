"""The queue with a `WavePolicy`: which queued requests run side by side, one group per rank (no process, no model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layerstream.request import GenerationRequest
from layerstream.server.output_loop import GroupWork
from layerstream.server.queue import GenerationQueue
from layerstream.server.served import ServedRequest
from layerstream.server.waves import WavePolicy

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

BASE = GenerationRequest(prompt="p", width=32, height=32, num_inference_steps=2, seed=1)


def _served(work: int = 1, **fields) -> ServedRequest:
    return ServedRequest(request=replace(BASE, **fields), work=work)


def _waves(requests: list[ServedRequest], *, num_ranks: int = 2, max_batch_size: int = 1) -> list[list[list[str]]]:
    """The waves the queue forms from `requests` queued at once: each a list of groups of prompts."""
    waves: list[list[list[str]]] = []
    policy = WavePolicy(num_ranks=num_ranks, max_batch_size=max_batch_size, wait_seconds=0.0, max_cost=10, idle_seconds=60)

    class Recorder:  # the runner: records each wave's groups
        def run(self, groups):
            waves.append([[job.served.prompt for job in group] for group in groups])
            return [None] * sum(map(len, groups))

        def after_run(self):
            pass

        def idle(self):
            pass

    queue = GenerationQueue(16, runner=Recorder(), policy=policy)
    jobs = [
        queue.submit(r, batch_key=r.batch_key() if max_batch_size > 1 else None, cost=r.work)
        for r in requests
    ]  # fmt: skip
    queue.start()  # after every submit: the first wave sees them all
    for job in jobs:
        job.future.result(timeout=10)
    queue.close()
    assert queue.join(10)
    return waves


def test_requests_alone_fill_one_rank_each_in_fifo_order():
    requests = [_served(prompt=str(i)) for i in range(5)]
    assert _waves(requests) == [[["0"], ["1"]], [["2"], ["3"]], [["4"]]]


def test_requests_with_other_forwards_wait_for_a_wave_of_their_own():
    other_steps = _served(prompt="steps", num_inference_steps=3)
    two_outputs = _served(prompt="n2", n=2)
    requests = [_served(prompt="a"), other_steps, two_outputs, _served(prompt="b")]
    assert _waves(requests) == [[["a"], ["b"]], [["steps"]], [["n2"]]]


def test_batches_spread_over_the_ranks_within_the_cost_cap():
    requests = [_served(prompt=str(i), work=4) for i in range(6)]
    # 2 ranks x 4 per batch, but a batch may cost 10: two requests of 4 each per rank
    assert _waves(requests, max_batch_size=4) == [[["0", "2"], ["1", "3"]], [["4"], ["5"]]]


@pytest.mark.parametrize("batch_call", [True, False])
def test_a_placeholder_runs_the_same_forwards_for_less(batch_call):
    work = GroupWork((replace(BASE, n=3), replace(BASE, prompt="q")), batch_call=batch_call)
    if not batch_call:
        work = GroupWork(work.requests[:1], batch_call=False)
    placeholder = work.as_placeholder()
    assert placeholder.placeholder and placeholder.batch_call == batch_call
    # a batch call: one output is enough; alone: every output is a call of its own
    assert placeholder.requests[0].seeds == ((1,) if batch_call else (1, 2, 3))


# --- stop points and heartbeats, on an in-memory store (no process group) -----------------------------------


def _setup(rank: int, store, timeout_s: float = 0.3):
    import datetime

    import torch

    from layerstream.server.ranks import RankSetup

    return RankSetup(rank, 2, torch.device("cpu"), "gloo", datetime.timedelta(seconds=timeout_s), store)


def test_every_rank_stops_at_the_checkpoint_rank_0_sets():
    import torch.distributed as dist

    from layerstream.server.ranks import STOP_LAG_CHECKPOINTS, WaveStop
    from layerstream.server.stopping import GenerationStopped, StopReason

    store = dist.HashStore()
    asked: list[StopReason | None] = [None]
    leader = WaveStop(store, 7, decide=lambda: asked[0])
    follower = WaveStop(store, 7)
    stopped_at = {}
    for checkpoint in range(1, 10):
        if checkpoint == 3:
            asked[0] = StopReason.TIMEOUT
        for name, stop in (("leader", leader), ("follower", follower)):
            if name in stopped_at:
                continue
            try:
                stop.checkpoint(f"checkpoint {checkpoint}")
            except GenerationStopped as e:
                assert e.reason is StopReason.TIMEOUT
                stopped_at[name] = checkpoint
    assert stopped_at == {"leader": 3 + STOP_LAG_CHECKPOINTS, "follower": 3 + STOP_LAG_CHECKPOINTS}
    # another wave has a stop point of its own
    WaveStop(store, 8).checkpoint("first")


def test_a_silent_rank_is_lost_after_the_collective_timeout():
    import time

    import torch.distributed as dist

    from layerstream.server.ranks import ControlChannel, RankGroupError

    store = dist.HashStore()
    rank1 = ControlChannel(_setup(1, store))  # beats every HEARTBEAT_S
    rank0 = ControlChannel(_setup(0, store))
    try:
        for _ in range(4):  # a live peer is never lost, however long we watch
            rank0.check_alive()
            time.sleep(0.2)
        rank1.close()
        with pytest.raises(RankGroupError, match="rank 1 has not answered"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                rank0.check_alive()
                time.sleep(0.05)
    finally:
        rank0.close()
        rank1.close()


def test_a_wave_carries_each_input_image_as_one_file():
    from PIL import Image

    from layerstream.server.ranks import WaveKind, WaveMessage

    work = GroupWork((replace(BASE, image=Image.new("RGB", (32, 16), (200, 80, 40))),), batch_call=False)
    message = WaveMessage(WaveKind.RUN, 1, (work, work.as_placeholder())).with_image_files()
    first, placeholder = (w.requests[0].image for w in message.works)
    assert first is placeholder and first.data.startswith(b"\x89PNG")  # a decoded picture: one PNG, shared
    assert message.with_image_files() == message  # files cross as they are
