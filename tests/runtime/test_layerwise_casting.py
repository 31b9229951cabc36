"""diffusers' layerwise casting composes with streaming: a model whose weights are stored in float8 by
`enable_layerwise_casting` streams those float8 bytes, and the casting hooks run on the device after the block
is bound, as they do resident. Group offloading and other diffusers hooks are still refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import OffloadError, enable_offload  # noqa: E402
from layerstream.models.loading import load_pipeline  # noqa: E402
from layerstream.models.tiny import TINY_MODELS  # noqa: E402

DITS = {"tiny-wan": ("transformer", "transformer_2"), "tiny-flux": ("transformer",), "tiny-qwen-image": ("transformer",)}


def _cast(pipe, model: str) -> None:
    for name in DITS[model]:
        getattr(pipe, name).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def _generate(pipe, model: str):
    kwargs = dict(TINY_MODELS[model].default_kwargs)
    kwargs.update(num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = pipe(prompt="a fox", **kwargs)
    return (out.frames if hasattr(out, "frames") else out.images).clone()


@pytest.mark.parametrize("components", [["dit"], ["dit", "text_encoder"]], ids=["dit", "dit+text"])
@pytest.mark.parametrize("model", list(DITS))
def test_layerwise_cast_models_stream_bit_identically(model, components):
    resident, streamed, plain = load_pipeline(model), load_pipeline(model), load_pipeline(model)
    _cast(resident, model)
    _cast(streamed, model)
    expected = _generate(resident, model)
    handle = enable_offload(streamed, {"mode": "layer", "components": components}, device="cpu")
    assert torch.equal(_generate(streamed, model), expected)
    assert torch.equal(_generate(streamed, model), expected)  # steady state too
    cast_bytes = handle.stats().per_component["transformer"].host_bytes
    plain_handle = enable_offload(plain, {"mode": "layer", "components": components}, device="cpu")
    full_bytes = plain_handle.stats().per_component["transformer"].host_bytes
    # float8 storage: the streamed linear weights are a quarter of their float32 bytes
    assert cast_bytes < 0.6 * full_bytes, (cast_bytes, full_bytes)
    plain_handle.disable()
    handle.disable()
    assert torch.equal(_generate(streamed, model), expected)


def test_group_offloading_is_still_refused():
    from diffusers.hooks import apply_group_offloading

    pipe = load_pipeline("tiny-flux")
    apply_group_offloading(pipe.transformer, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    with pytest.raises(OffloadError, match="group_offloading|layerwise casting is the one kind"):
        enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
