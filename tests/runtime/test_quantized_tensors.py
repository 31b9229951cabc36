"""Quantized weights in streamed blocks: a tensor subclass layerstream cannot pack is refused at enable, naming
the tensor and its type, before anything changes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import OffloadError, UnsupportedTensorError, enable_offload  # noqa: E402
from tests.runtime.tiny_pipelines import DIT, load  # noqa: E402


def _tensors(pipe) -> dict[str, tuple[torch.Tensor, object]]:
    return {f"transformer.{n}": (t, type(t)) for n, t in pipe.transformer.named_parameters()}


@pytest.mark.parametrize("scheme", ["int8", "float8"])
def test_torchao_quantized_blocks_are_refused_before_anything_changes(scheme):
    torchao = pytest.importorskip("torchao.quantization")
    config = torchao.Int8WeightOnlyConfig() if scheme == "int8" else torchao.Float8WeightOnlyConfig()
    pipe = load("flux")
    torchao.quantize_(pipe.transformer.transformer_blocks[1], config)
    before = _tensors(pipe)
    devices = {n: t.device for n, (t, _) in before.items()}
    with pytest.raises(UnsupportedTensorError, match=r"transformer\.transformer_blocks\.1\.\S+\.weight is a torchao") as info:
        enable_offload(pipe, DIT, device="cpu")
    assert isinstance(info.value, OffloadError) and isinstance(info.value, TypeError)
    after = _tensors(pipe)
    assert after.keys() == before.keys()
    for name, (tensor, cls) in before.items():
        assert after[name][0] is tensor and type(after[name][0]) is cls and tensor.device == devices[name]
    assert getattr(pipe.transformer, "_layerstream_offload", None) is None
    with torch.no_grad():
        pipe.transformer.transformer_blocks[1].attn.to_q(torch.randn(1, 4, pipe.transformer.transformer_blocks[1].attn.to_q.in_features))
