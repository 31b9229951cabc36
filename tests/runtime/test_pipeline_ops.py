"""What else a diffusers user does to an offloaded pipeline (issue 15, items 3 and 5), on tiny Wan 2.2 and Flux:
`pipe.to(...)` and copying are refused with one clear error before anything changes; `save_pretrained` writes
the real weights; VAE tiling and attention slicing compose."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from layerstream import UnsupportedUseError, enable_offload
from tiny_pipelines import DIT, KINDS, generate, load


def _dtypes(pipe) -> dict[str, torch.dtype]:
    return {name: m.dtype for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


MOVES = {
    "dtype": lambda p: p.to(torch.float16),
    "device": lambda p: p.to("cpu"),
    "both": lambda p: p.to("cpu", torch.bfloat16),
    "model_cpu_offload": lambda p: p.enable_model_cpu_offload(),
}


@pytest.mark.parametrize("kind", KINDS)
def test_moving_or_converting_the_pipeline_is_refused_before_any_component_changes(kind):
    pipe = load(kind)
    expected = generate(pipe, kind)
    handle = enable_offload(pipe, DIT, device="cpu")
    dtypes = _dtypes(pipe)
    for name, operation in MOVES.items():
        with pytest.raises(UnsupportedUseError, match=r"offload enabled on transformer.*Nothing was changed; call handle\.disable\(\)"):
            operation(pipe)
        assert _dtypes(pipe) == dtypes, name  # the text encoders come before the transformer in pipe.to's order
    assert torch.equal(generate(pipe, kind), expected)
    handle.disable()
    pipe.to(torch.float64)  # allowed again
    assert pipe.text_encoder.dtype == torch.float64


@pytest.mark.parametrize(
    "operation", [copy.deepcopy, pickle.dumps, lambda p: copy.deepcopy(p.transformer)], ids=["deepcopy", "pickle", "deepcopy-transformer"]
)
def test_copying_an_offloaded_pipeline_is_refused_with_a_clear_error(operation):
    pipe = load("wan")
    handle = enable_offload(pipe, DIT, device="cpu")
    with pytest.raises(UnsupportedUseError, match=r"offload enabled.*placeholders.*handle\.disable\(\)"):
        operation(pipe)
    handle.disable()
    assert torch.equal(copy.deepcopy(pipe).transformer.blocks[0].ffn.net[2].weight, pipe.transformer.blocks[0].ffn.net[2].weight)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_writes_the_real_weights(kind, tmp_path):
    from safetensors.torch import load_file

    resident, streamed = load(kind), load(kind)
    handle = enable_offload(streamed, DIT, device="cpu")
    generate(streamed, kind)  # blocks have been through the slots
    resident.save_pretrained(tmp_path / "resident")
    streamed.save_pretrained(tmp_path / "streamed")
    for folder in sorted((tmp_path / "resident").iterdir()):
        for file in folder.glob("*.safetensors"):
            saved, expected = load_file(tmp_path / "streamed" / folder.name / file.name), load_file(file)
            assert saved.keys() == expected.keys(), file
            assert all(torch.equal(saved[k], expected[k]) for k in expected), file
    assert handle.enabled
    assert torch.equal(generate(streamed, kind), generate(resident, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_vae_tiling_and_attention_slicing_compose(kind):
    resident, streamed = load(kind), load(kind)
    handle = enable_offload(streamed, DIT, device="cpu")
    for pipe in (resident, streamed):
        pipe.vae.enable_tiling()
        for name, value in (("tile_sample_min_height", 32), ("tile_sample_min_width", 32), ("tile_sample_stride_height", 16),
                            ("tile_sample_stride_width", 16), ("tile_sample_min_size", 32), ("tile_latent_min_size", 4)):
            if hasattr(pipe.vae, name):
                setattr(pipe.vae, name, value)  # tiles smaller than the image, so tiling really runs
        try:
            pipe.enable_attention_slicing()
        except (AttributeError, NotImplementedError, ValueError):
            pass  # the DiT has no sliceable attention: nothing to compose
    images = [generate(p, kind, output_type="pt", height=64, width=64) for p in (resident, streamed)]
    assert torch.equal(images[0], images[1])
    handle.disable()
