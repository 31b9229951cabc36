"""Parameters made under `torch.inference_mode()` (issue 26 item 10): loaders and tests often build models there,
and such a model's parameters are inference tensors. Streamed, they compute bit for bit as resident, inside
inference mode and out of it, and `disable()` gives back parameters that work as before."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from runtime_toys import ToyDiT, run, snapshot, tiny_wan_transformer

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def _toy():
    torch.manual_seed(0)
    return ToyDiT(dim=32, num_blocks=4).eval(), {"x": torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))}


FACTORIES = {"toy": _toy, "wan": tiny_wan_transformer}


def _built_in_inference_mode(factory):
    """The model built under inference mode, and its inputs as normal tensors."""
    with torch.inference_mode():
        model, inputs = factory()
    assert all(p.is_inference() for p in model.parameters())
    return model, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _run_inference_mode(model, inputs):
    with torch.inference_mode():
        return run(model, inputs)


@pytest.mark.parametrize("kind", FACTORIES)
def test_a_model_built_under_inference_mode_streams_bit_identically(kind):
    resident, inputs = _built_in_inference_mode(FACTORIES[kind])
    streamed, _ = _built_in_inference_mode(FACTORIES[kind])
    expected = run(resident, inputs)
    assert torch.equal(_run_inference_mode(resident, inputs), expected)
    params = dict(streamed.named_parameters())
    before = snapshot(streamed)

    handle = enable_offload(streamed, DIT, device="cpu")
    for _ in range(2):  # the second pass reuses the slots' cached views
        assert torch.equal(run(streamed, inputs), expected)  # under no_grad, outside inference mode
        assert torch.equal(_run_inference_mode(streamed, inputs), expected)
    stats = handle.stats()
    assert stats.num_streamed_blocks > 0 and stats.max_materialized_blocks <= stats.num_slots
    assert all(p.is_inference() for p in streamed.parameters())  # evicted placeholders are inference tensors too
    state = streamed.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    handle.disable()

    assert dict(streamed.named_parameters()) == params  # the same Parameter objects
    assert all(p.is_inference() for p in streamed.parameters())
    after = snapshot(streamed)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(run(streamed, inputs), expected)
    assert torch.equal(_run_inference_mode(streamed, inputs), expected)


def test_inference_parameters_stream_from_the_disk_tier_and_in_float8(tmp_path):
    """The other stores bind through the same rule: blocks beyond the host budget (read from spill files), and
    float8 storage (compared with the same model built normally and streamed the same way)."""
    resident, inputs = _built_in_inference_mode(_toy)
    block_bytes = sum(t.numel() * t.element_size() for t in snapshot(resident.blocks[0]).values())
    disk = {**DIT, "host_budget_gb": 1.5 * block_bytes / 1e9, "disk_dir": str(tmp_path)}
    streamed, _ = _built_in_inference_mode(_toy)
    handle = enable_offload(streamed, disk, device="cpu")
    assert handle.placement.host_tier is not None and handle.placement.host_tier.disk_block_paths
    assert torch.equal(run(streamed, inputs), run(resident, inputs))
    assert torch.equal(_run_inference_mode(streamed, inputs), run(resident, inputs))
    handle.disable()
    assert torch.equal(run(streamed, inputs), run(resident, inputs))

    fp8 = {**DIT, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    normal, _ = _toy()
    streamed, _ = _built_in_inference_mode(_toy)
    normal_handle = enable_offload(normal, fp8, device="cpu")
    handle = enable_offload(streamed, fp8, device="cpu")
    expected = run(normal, inputs)
    assert torch.equal(run(streamed, inputs), expected)
    assert torch.equal(_run_inference_mode(streamed, inputs), expected)
    handle.disable()
    normal_handle.disable()
    assert all(p.is_inference() for p in streamed.parameters())
    assert torch.equal(run(streamed, inputs), run(normal, inputs))


def test_load_state_dict_under_inference_mode_while_enabled_matches_resident():
    resident, inputs = _built_in_inference_mode(_toy)
    streamed, _ = _built_in_inference_mode(_toy)
    torch.manual_seed(5)
    new_state = {k: torch.randn_like(v) for k, v in snapshot(resident).items()}
    handle = enable_offload(streamed, DIT, device="cpu")
    with torch.inference_mode():  # an inference tensor may be written only there, resident or streamed
        resident.load_state_dict(new_state)
        streamed.load_state_dict(new_state)
    assert torch.equal(run(streamed, inputs), run(resident, inputs))
    handle.disable()
    assert torch.equal(run(streamed, inputs), run(resident, inputs))


def test_disable_inside_inference_mode_gives_normal_parameters_back():
    """A normal model disabled under inference mode keeps normal parameters: an inference tensor as a normal
    parameter's `.data` would silently take it out of autograd (its gradient stays None)."""
    resident, inputs = _toy()
    streamed, _ = _toy()
    handle = enable_offload(streamed, DIT, device="cpu")
    assert torch.equal(_run_inference_mode(streamed, inputs), run(resident, inputs))
    with torch.inference_mode():
        handle.disable()
    assert not any(p.is_inference() for p in streamed.parameters())
    for model in (resident, streamed):
        model(**inputs).square().sum().backward()
    grads = {n: p.grad for n, p in resident.named_parameters()}
    assert all(p.grad is not None and torch.equal(p.grad, grads[n]) for n, p in streamed.named_parameters())


def test_tensors_replaced_at_enable_keep_inference_parameters_working():
    """Enabling moves every tensor that does not stream to the device (`replace_tensors_`; on an accelerator a
    copy made outside inference mode): an inference parameter gets its copy as an inference tensor."""
    from layerstream.runtime.packing.tensors import replace_tensors_

    resident, inputs = _built_in_inference_mode(_toy)
    model, _ = _built_in_inference_mode(_toy)
    params = dict(model.named_parameters())
    undo = []
    replace_tensors_(model, "", set(), lambda t: t.clone(), undo.append)  # a new, normal tensor for each
    assert len(undo) == len(params) + len(dict(model.named_buffers()))
    assert dict(model.named_parameters()) == params and all(p.is_inference() for p in params.values())
    assert torch.equal(run(model, inputs), run(resident, inputs))
    assert torch.equal(_run_inference_mode(model, inputs), run(resident, inputs))
    for step in reversed(undo):
        step()
    assert torch.equal(run(model, inputs), run(resident, inputs))
