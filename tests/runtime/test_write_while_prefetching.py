"""Writing a streamed block's host bytes while its copy is in flight, or after it was prefetched.

The last block of a forward prefetches the first one for the next call, so when a forward returns the first
block's copy may still be running on the copy thread, or be done and waiting in its slot. Whatever writes the
host store next (`load_state_dict`, an in-place write through a tensor of `state_dict()`, LoRA fusing and
unfusing) must reach the next forward: every test compares it with a resident model given the same write, bit
for bit. The copy is held mid-way by a gate (its first part read before the write, the rest after it), or made
slow by the engine's simulated link.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from layerstream import enable_offload
from runtime_toys import ToyDiT, run

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}
NUM_BLOCKS = 4


def _pair():
    torch.manual_seed(0)
    resident = ToyDiT(dim=32, num_blocks=NUM_BLOCKS).eval()
    return resident, copy.deepcopy(resident), (torch.randn(2, 3, 32),)


def _other_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return ToyDiT(dim=32, num_blocks=NUM_BLOCKS).eval().state_dict()


def _slow_link_gbps(model) -> float:
    """A simulated link on which one block's copy lasts about 30 ms (the toy's compute takes far less)."""
    block_bytes = sum(t.numel() * t.element_size() for t in model.blocks[0].state_dict().values())
    return block_bytes / 0.03 / 1e9


class CopyGate:
    """Holds the next copy of one block on the copy thread: it copies the first `fraction` of the block's bytes,
    says so (`started`), waits for `go`, then copies the rest. It stands in for the store's own job (one
    contiguous copy of the packed bytes), so the slot ends up holding what a copy overlapping the write reads.
    With `fails`, the held copy raises once let go (a failed read), after reading all of it."""

    def __init__(self, stored, fraction: float, *, fails: bool = False):
        self.stored = stored
        self.fraction = fraction
        self.fails = fails
        self.started = threading.Event()
        self.go = threading.Event()
        self.num_held = 0
        self._own_job = stored.copy_job
        stored.copy_job = self._copy_job  # the instance's, for the next copy only

    def _copy_job(self, slot_buffer: torch.Tensor):
        del self.stored.copy_job  # later copies are the store's own again
        source, nbytes = self.stored.buffer, self.stored.layout.nbytes
        cut = int(nbytes * self.fraction)

        def job() -> int:
            self.num_held += 1
            slot_buffer[:cut].copy_(source[:cut])
            self.started.set()
            assert self.go.wait(timeout=30), "the test never let the held copy go on"
            slot_buffer[cut:nbytes].copy_(source[cut:nbytes])
            if self.fails:
                raise OSError("the held copy failed")
            return nbytes

        return job

    def release(self) -> None:
        self.go.set()


def _forward_leaving_block_0_held(handle, streamed, x, fraction: float, *, fails: bool = False) -> CopyGate:
    """Run a forward whose last block prefetches block 0 through a gate; return once the gated copy has read the
    first `fraction` of the bytes (the forward itself has returned: compute does not wait for that copy)."""
    run(streamed, x)  # block 0 was a synchronous load; the last block prefetched it again
    gate = CopyGate(handle.streamer.blocks[0].host, fraction, fails=fails)
    run(streamed, x)  # block 2 took block 0's slot, so the last block copies block 0 anew, through the gate
    assert gate.started.wait(timeout=30) and gate.num_held == 1
    return gate


def _enable(streamed, **kwargs):
    handle = enable_offload(streamed, DIT, device="cpu", **kwargs)
    assert handle.streamer.num_slots < NUM_BLOCKS  # block 0's slot is reused within a forward
    return handle


def _write_through_state_dict_(model) -> None:
    """An in-place write through the tensors `state_dict()` gives (they alias the weights, as on the resident
    model): the first block's weights, and one block further on."""
    state = model.state_dict()
    with torch.no_grad():
        state["blocks.0.proj.weight"].mul_(-2.0)
        state["blocks.0.scale"].add_(0.25)
        state["blocks.2.out.weight"].mul_(0.5)


WRITES = {
    "load_state_dict": lambda model: model.load_state_dict(_other_weights()),
    "state_dict_tensors": _write_through_state_dict_,
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0], ids=["before-reading", "half-read", "all-read"])
def test_a_write_while_the_first_blocks_prefetch_is_in_flight_reaches_the_next_forward(write, fraction):
    resident, streamed, x = _pair()
    handle = _enable(streamed)
    run(resident, x)
    gate = _forward_leaving_block_0_held(handle, streamed, x, fraction)
    try:
        WRITES[write](streamed)  # while the copy thread holds block 0's copy part-way
        WRITES[write](resident)
    finally:
        gate.release()
    assert torch.equal(run(streamed, x), run(resident, x))
    assert torch.equal(run(streamed, x), run(resident, x))  # and the call after it, from the prefetched slot
    handle.disable()
    assert torch.equal(run(streamed, x), run(resident, x))


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_superseded_copy_that_fails_after_the_write_does_not_fail_the_next_forward(write):
    resident, streamed, x = _pair()
    handle = _enable(streamed)
    run(resident, x)
    gate = _forward_leaving_block_0_held(handle, streamed, x, 0.5, fails=True)
    WRITES[write](streamed)
    WRITES[write](resident)
    if write == "load_state_dict":
        assert handle.streamer.blocks[0].slot is None  # forgotten at once: the next call copies block 0 again
    timer = threading.Timer(0.2, gate.release)  # fails once the next forward has queued block 0's new copy
    timer.start()
    try:
        assert torch.equal(run(streamed, x), run(resident, x))  # that copy's bytes, not the old one's error
    finally:
        timer.cancel()
        gate.release()
    assert torch.equal(run(streamed, x), run(resident, x))
    handle.disable()


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_right_after_a_forward_on_a_slow_link_reaches_the_next_forward(write):
    resident, streamed, x = _pair()
    handle = _enable(streamed, simulated_link_gbps=_slow_link_gbps(resident))
    assert torch.equal(run(streamed, x), run(resident, x))
    WRITES[write](streamed)  # block 0's prefetch is still crossing the simulated link
    WRITES[write](resident)
    assert torch.equal(run(streamed, x), run(resident, x))
    handle.disable()
    assert torch.equal(run(streamed, x), run(resident, x))


def test_a_write_after_the_prefetch_landed_reaches_the_next_forward_and_costs_one_copy():
    resident, streamed, x = _pair()
    handle = _enable(streamed)
    for _ in range(2):
        assert torch.equal(run(streamed, x), run(resident, x))
    engine, slot = handle.streamer.engine, handle.streamer.blocks[0].slot
    engine.wait_ready(slot)  # block 0's prefetch has landed: its slot holds the bytes from before the write
    engine.release(slot)
    before = handle.stats().num_sync_loads
    _write_through_state_dict_(streamed)
    _write_through_state_dict_(resident)
    assert torch.equal(run(streamed, x), run(resident, x))
    assert handle.stats().num_sync_loads == before + 1  # block 0 copied again, once; the others as always
    assert torch.equal(run(streamed, x), run(resident, x))
    assert handle.stats().num_sync_loads == before + 1
    handle.disable()


# --- LoRA: fusing and unfusing write the host store right after a forward -----------------------------------------


@pytest.mark.parametrize("kind", ["flux"])
def test_fuse_and_unfuse_right_after_a_forward_on_a_slow_link_match_the_resident_pipeline(kind, tmp_path):
    pytest.importorskip("peft")
    from tiny_pipelines import generate, load, write_lora_file

    resident, streamed = load(kind), load(kind)
    lora = write_lora_file(resident, tmp_path, seed=1)
    block_bytes = max(b.host.layout.nbytes for b in enable_offload(load(kind), DIT, device="cpu").streamer.blocks)
    handle = enable_offload(streamed, DIT, device="cpu", simulated_link_gbps=block_bytes / 0.02 / 1e9)
    base = generate(resident, kind)
    for pipe in (resident, streamed):
        pipe.load_lora_weights(str(lora), adapter_name="first")
    assert torch.equal(generate(streamed, kind), generate(resident, kind))
    for pipe in (resident, streamed):
        pipe.fuse_lora(lora_scale=0.8)  # right after a generation: the first block's prefetch is in flight
        pipe.unload_lora_weights()  # the fused weights stay
    fused = generate(resident, kind)
    assert not torch.equal(fused, base)
    assert torch.equal(generate(streamed, kind), fused)
    handle.disable()
    assert torch.equal(generate(streamed, kind), fused)


# --- float8 storage: a buffer a forward writes is stored rounded, and the next call reads it rounded ---------------


class AveragingLinear(torch.nn.Linear):
    """A Linear that keeps a running mean of its output in a buffer, written in place by every forward (float8
    storage casts a Linear's buffers too, so the store keeps it rounded)."""

    def __init__(self, dim: int):
        super().__init__(dim, dim)
        self.register_buffer("mean", torch.zeros(dim))

    def forward(self, x):
        out = super().forward(x)
        self.mean.mul_(0.5).add_(out.detach().mean(dim=(0, 1)), alpha=0.5)
        return out + self.mean


class AveragingDiT(torch.nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, dim: int = 16, num_blocks: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(AveragingLinear(dim) for _ in range(num_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_float8_block_still_in_its_slot_reads_the_rounded_buffer_it_wrote_as_layerwise_casting_does():
    pytest.importorskip("diffusers")
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    resident = AveragingDiT().eval()
    streamed = copy.deepcopy(resident)
    for block in resident.blocks:  # diffusers' casting of the streamed blocks: rounded after every forward
        apply_layerwise_casting(block, torch.float8_e4m3fn, torch.float32, skip_modules_pattern=())
    config = {**DIT, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    handle = enable_offload(streamed, config, device="cpu")
    assert handle.streamer.num_slots >= len(resident.blocks)  # every block stays in its slot between calls
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        assert torch.equal(run(streamed, (x,)), run(resident, (x,)))
    assert handle.stats().bytes_written_back > 0
    handle.disable()
