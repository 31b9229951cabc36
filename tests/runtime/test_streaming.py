"""Layer mode on CPU: outputs bit-identical to resident, bounded materialization, overlap, disable/enable."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from layerstream import enable_offload
from runtime_toys import (
    observe_bound_blocks,
    make_my_pipeline,
    run,
    snapshot,
    tiny_flux2_transformer,
    tiny_flux_transformer,
    tiny_umt5_encoder,
    tiny_wan_transformer,
    toy_inputs,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


class EncoderPipeline(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.text_encoder = encoder


def _bare(factory):
    model, inputs = factory()
    return model, inputs, DIT


def _umt5():
    model, inputs = tiny_umt5_encoder()
    pipe = EncoderPipeline(model)
    return pipe, inputs, {"mode": "layer", "components": ["text_encoder"]}


CASES = {
    "wan": lambda: _bare(tiny_wan_transformer),
    "flux": lambda: _bare(tiny_flux_transformer),
    "flux2": lambda: _bare(tiny_flux2_transformer),
    "umt5": _umt5,
}


def _call(pipe, inputs):
    if isinstance(pipe, EncoderPipeline):
        return run(pipe.text_encoder, inputs)
    return run(pipe, inputs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_diffusers_models_bit_identical_over_calls_and_cycles(name):
    pipe, inputs, config = CASES[name]()
    expected = _call(pipe, inputs)
    params_before = {k: p for k, p in pipe.named_parameters()}
    for _cycle in range(2):
        handle = enable_offload(pipe, config, device="cpu")
        assert handle.stats().num_streamed_blocks >= 2
        for _call_index in range(3):
            assert torch.equal(_call(pipe, inputs), expected)
        stats = handle.stats()
        assert stats.num_transfers > 0 and stats.max_materialized_blocks <= stats.num_slots
        handle.disable()
        assert torch.equal(_call(pipe, inputs), expected)
    # disable gives back the same Parameter objects
    assert all(p is params_before[k] for k, p in pipe.named_parameters())


@pytest.mark.parametrize("components", [["dit"], ["text_encoder"], ["dit", "text_encoder"]])
def test_custom_pipeline_each_selection_bit_identical(components):
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    state = snapshot(pipe)
    handle = enable_offload(pipe, {"mode": "layer", "components": components}, device="cpu")
    for _ in range(3):
        assert torch.equal(run(pipe, (ids, x)), expected)
    per = handle.stats().per_component
    if "text_encoder" in components:
        assert per["prompt_model"].num_streamed_blocks == 3
        # the encoder's non-block parts stay resident (real tensors, not placeholders)
        assert pipe.prompt_model.embed_tokens.weight.numel() > 0 and pipe.prompt_model.final_norm.weight.numel() > 0
    if "dit" in components:
        assert per["transformer"].num_streamed_blocks == 4
    handle.disable()
    after = snapshot(pipe)
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_evicted_blocks_hold_placeholders_and_stray_use_raises():
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, DIT, device="cpu")
    block = pipe.transformer.blocks[1]
    assert block.proj.weight.numel() == 0  # evicted between forwards
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.randn(2, 32), block.proj.weight)
    handle.disable()
    assert block.proj.weight.shape == (64, 32)


def test_never_more_than_slot_count_materialized():
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]}, device="cpu")
    seen = []

    def check(streamer):
        live = [b for b in streamer.blocks if next(b.module.parameters()).numel() > 0]
        seen.append(len(live))
        assert len(live) <= streamer.num_slots

    observe_bound_blocks(handle, check)
    run(pipe, (ids, x))
    run(pipe, (ids, x))
    assert len(seen) == 2 * (4 + 3) and max(seen) >= 1
    assert handle.stats().max_materialized_blocks <= handle.stats().num_slots == 2


def test_host_bytes_match_streamed_bytes_within_two_percent():
    torch.manual_seed(0)
    from runtime_toys import ToyDiT

    model = ToyDiT(dim=256, num_blocks=4)
    streamed = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    streamed += sum(b.numel() * b.element_size() for b in model.blocks.buffers())
    handle = enable_offload(model, DIT, device="cpu")
    host = handle.stats().host_bytes
    assert streamed <= host <= streamed * 1.02
    handle.disable()


def test_overlap_recorded_with_simulated_link():
    """Block i+1's copy starts before block i's compute ends when the link is about as fast as compute."""
    torch.manual_seed(0)
    from runtime_toys import ToyDiT

    model = ToyDiT(dim=256, num_blocks=6)
    x = torch.randn(4, 256, 256)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    with torch.no_grad():
        model(x)
        import time

        start = time.perf_counter()
        model.blocks[0](x)
        compute = time.perf_counter() - start
    gbps = block_bytes / max(compute, 1e-4) / 1e9  # one block's copy takes about one block's compute
    handle = enable_offload(model, DIT, device="cpu", simulated_link_gbps=gbps)
    with torch.no_grad():
        model(x)
        handle.reset_trace()
        model(x)
    trace = handle.trace()
    copies = {i.label: i for i in trace.lane("copy")}
    computes = [i for i in trace.lane("compute")]
    assert len(computes) == 6
    overlapped = 0
    for current, following in zip(computes, computes[1:]):
        copy = copies.get(following.label)
        if copy is not None and copy.start < current.end:
            overlapped += 1
    assert overlapped >= 4
    handle.disable()


def test_slow_link_raises_stall_counter():
    torch.manual_seed(0)
    from runtime_toys import ToyDiT

    model = ToyDiT(dim=128, num_blocks=4)
    x = torch.randn(1, 4, 128)
    fast = enable_offload(model, DIT, device="cpu")
    with torch.no_grad():
        model(x)
    fast_stall = fast.stats().stall_seconds
    fast.disable()
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    slow = enable_offload(model, DIT, device="cpu", simulated_link_gbps=block_bytes / 0.02 / 1e9)  # 20 ms a block
    with torch.no_grad():
        model(x)
    slow_stall = slow.stats().stall_seconds
    slow.disable()
    assert slow_stall > fast_stall
    assert slow_stall > 0


def test_second_thread_is_refused_while_model_runs():
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, DIT, device="cpu")
    inside = threading.Event()
    release = threading.Event()
    errors = []

    def slow_hook(module, args):
        inside.set()
        release.wait(timeout=10)

    hook = pipe.transformer.blocks[2].register_forward_pre_hook(slow_hook)

    def first():
        run(pipe, (ids, x))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(timeout=10)
    try:
        run(pipe.transformer, (x,))
    except Exception as e:  # noqa: BLE001 - the type is asserted below
        errors.append(e)
    release.set()
    t.join(timeout=10)
    hook.remove()
    from layerstream.errors import ConcurrentUseError

    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
    assert torch.equal(run(pipe, (ids, x)), expected)
    handle.disable()
