"""The CUDA path for real: streams, events, pinned host buffers. Skipped on machines without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from runtime_toys import ToyDiT, make_my_pipeline, run, toy_inputs  # noqa: E402

from layerstream import enable_offload  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DIT = {"mode": "layer", "components": ["dit"]}


def _resident_copy(factory):
    model = factory()
    reference = factory().cuda()
    return model, reference


def test_toy_dit_bit_identical_on_cuda_with_pinned_store():
    torch.manual_seed(0)
    model = ToyDiT(dim=256, num_blocks=6).eval()
    torch.manual_seed(0)
    reference = ToyDiT(dim=256, num_blocks=6).eval().cuda()
    x = torch.randn(4, 64, 256, device="cuda")
    expected = run(reference, (x,))
    handle = enable_offload(model, DIT, device="cuda")
    stats = handle.stats()
    assert stats.engine == "accelerator-streams"
    assert stats.pinned_host_bytes == stats.host_bytes > 0
    for _ in range(3):
        assert torch.equal(run(model, (x,)), expected)
    stats = handle.stats()
    assert stats.max_materialized_blocks <= stats.num_slots
    assert stats.num_sync_loads <= 1
    handle.disable()
    assert torch.equal(run(model, (x,)), expected)


def test_no_cpu_synchronize_in_the_steady_state():
    torch.manual_seed(0)
    model = ToyDiT(dim=128, num_blocks=4).eval()
    x = torch.randn(2, 16, 128, device="cuda")
    handle = enable_offload(model, DIT, device="cuda")
    run(model, (x,))  # warm-up: learns the order, fills the ring
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call in the forward raises
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape
    handle.disable()


def test_custom_pipeline_dit_and_text_encoder_on_cuda():
    pipe = make_my_pipeline()
    reference = make_my_pipeline().cuda()
    ids, x = toy_inputs()
    expected = run(reference, (ids.cuda(), x.cuda()))
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]}, device="cuda")
    for _ in range(2):
        assert torch.equal(run(pipe, (ids.cuda(), x.cuda())), expected)
    handle.disable()


def test_cuda_trace_has_copy_timings():
    torch.manual_seed(0)
    model = ToyDiT(dim=256, num_blocks=4).eval()
    x = torch.randn(2, 64, 256, device="cuda")
    handle = enable_offload(model, DIT, device="cuda", trace=True)
    run(model, (x,))
    trace = handle.trace()
    assert len(trace.lane("copy")) >= 3 and len(trace.lane("compute")) == 4
    handle.disable()


def test_diffusers_wan_transformer_on_cuda():
    pytest.importorskip("diffusers")
    from runtime_toys import tiny_wan_transformer

    model, inputs = tiny_wan_transformer()
    reference, _ = tiny_wan_transformer()
    reference = reference.cuda()
    cuda_inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    expected = run(reference, cuda_inputs)
    handle = enable_offload(model, DIT, device="cuda")
    assert torch.equal(run(model, cuda_inputs), expected)
    assert torch.equal(run(model, cuda_inputs), expected)
    handle.disable()
