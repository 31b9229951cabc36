"""Float8 storage and torchao weights on CUDA for real: the cast runs on the copy stream into the slot, and a
wrapper subclass bound on the device. Skipped on machines without a GPU (not yet run on one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from runtime_toys import ToyDiT, run  # noqa: E402

from layerstream import enable_offload  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cast_blocks_resident(model: ToyDiT, storage_dtype: torch.dtype) -> None:
    from diffusers.hooks import apply_layerwise_casting

    for block in model.blocks:
        apply_layerwise_casting(block, storage_dtype, torch.bfloat16, skip_modules_pattern="auto")


def test_fp8_storage_on_cuda_matches_layerwise_casting_resident():
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = ToyDiT(dim=256, num_blocks=6).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    reference = ToyDiT(dim=256, num_blocks=6).eval().to(torch.bfloat16)
    _cast_blocks_resident(reference, torch.float8_e4m3fn)
    reference.cuda()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    expected = run(reference, (x,))
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    handle = enable_offload(model, config, device="cuda")
    for _ in range(3):
        assert torch.equal(run(model, (x,)), expected)
    assert handle.stats().pinned_host_bytes == handle.stats().host_bytes > 0
    handle.disable()


def test_torchao_int8_blocks_on_cuda_match_resident():
    torchao = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    model = ToyDiT(dim=256, num_blocks=6).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    reference = ToyDiT(dim=256, num_blocks=6).eval().to(torch.bfloat16).cuda()
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    torchao.quantize_(reference, torchao.Int8WeightOnlyConfig())
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    expected = run(reference, (x,))
    handle = enable_offload(model, {"mode": "layer", "components": ["dit"]}, device="cuda")
    for _ in range(3):
        assert torch.equal(run(model, (x,)), expected)
    handle.disable()
