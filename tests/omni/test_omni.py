"""Omni end to end on the embedded tiny pipelines: outputs bit-identical to the resident pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from layerstream.omni import GenerationError, Omni

MODELS = ["tiny-wan", "tiny-flux", "tiny-qwen-image"]
SELECTIONS = [["dit"], ["text_encoder"], ["dit", "text_encoder"]]
_reference_cache: dict[str, np.ndarray] = {}


def resident_reference(model: str) -> np.ndarray:
    if model not in _reference_cache:
        omni = Omni(model, device="cpu", offload=False)
        _reference_cache[model] = omni.generate("a red fox", seed=3, keep_raw=True).raw
    return _reference_cache[model]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("components", SELECTIONS, ids="+".join)
def test_layer_mode_bit_identical_to_resident(model, components):
    omni = Omni(model, {"mode": "layer", "components": components}, device="cpu")
    result = omni.generate("a red fox", seed=3, keep_raw=True)
    assert np.array_equal(result.raw, resident_reference(model))
    stats = omni.stats()
    for comp in omni.handle.plan.streamed:
        per = stats.per_component[comp.path]
        assert per.num_streamed_blocks > 0 and per.host_bytes > 0
    assert result.stats.bytes_transferred > 0
    assert len(result.stats.step_seconds) == 4
    omni.close()


@pytest.mark.parametrize("model", MODELS)
def test_module_mode_bit_identical_to_resident(model):
    omni = Omni(model, {"mode": "module", "components": ["dit", "text_encoder", "vae"]}, device="cpu")
    result = omni.generate("a red fox", seed=3, keep_raw=True)
    assert np.array_equal(result.raw, resident_reference(model))
    assert result.stats.num_transfers > 0
    omni.close()


def test_wan22_only_the_running_expert_streams():
    omni = Omni("tiny-wan", {"mode": "layer", "components": ["dit"]}, device="cpu")
    pipe = omni.pipeline
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_pre_hook(lambda m, a, n=name: calls.__setitem__(n, calls[n] + 1))
    result = omni.generate("a red fox", seed=3, keep_raw=True)
    assert np.array_equal(result.raw, resident_reference("tiny-wan"))
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0  # the generation switched experts
    transfers = omni.handle.block_transfers()
    for name, n_calls in calls.items():
        blocks = [p for p in transfers if p.startswith(name + ".")]
        moved = sum(transfers[p] for p in blocks)
        # every forward of an expert streams its blocks once; the idle expert streams nothing (at most the
        # wrap-around prefetch of its first block when the other expert takes over)
        assert n_calls * len(blocks) - len(blocks) <= moved <= n_calls * len(blocks) + 1
    # neither expert's blocks are on the device between forwards: only non-block modules and the slots
    for block in pipe.transformer.blocks:
        assert block.attn1.to_q.weight.numel() == 0
    for block in pipe.transformer_2.blocks:
        assert block.attn1.to_q.weight.numel() == 0


def test_text_encoder_streams_and_keeps_non_block_parts_resident():
    omni = Omni("tiny-wan", {"mode": "layer", "components": ["text_encoder"]}, device="cpu")
    te = omni.pipeline.text_encoder
    assert te.shared.weight.numel() > 0 and te.encoder.final_layer_norm.weight.numel() > 0
    assert all(block.layer[0].SelfAttention.q.weight.numel() == 0 for block in te.encoder.block)
    assert omni.stats().per_component["text_encoder"].num_streamed_blocks == len(te.encoder.block)


def test_generate_rejects_bad_arguments():
    omni = Omni("tiny-flux", device="cpu")
    with pytest.raises(GenerationError, match="num_frames"):
        omni.generate("x", num_frames=5)
    with pytest.raises(GenerationError, match="num_inference_steps"):
        omni.generate("x", num_inference_steps=0)


def test_save_formats(tmp_path):
    import imageio.v3 as iio

    video = Omni("tiny-wan", device="cpu").generate("a fox", num_inference_steps=2, seed=0)
    for suffix in (".gif", ".mp4"):
        path = video.save(tmp_path / f"out{suffix}")
        frames = iio.imread(path, index=None)
        assert frames.shape[0] == video.frames.shape[0]
    with pytest.raises(GenerationError, match=r"\.png"):
        video.save(tmp_path / "out.png")
    image = Omni("tiny-flux", device="cpu").generate("a fox", num_inference_steps=2, seed=0)
    path = image.save(tmp_path / "img.png")
    assert np.array_equal(iio.imread(path), image.frames[0])


def test_generate_rejects_sizes_and_frame_counts_the_pipeline_would_round():
    omni = Omni("tiny-wan", device="cpu")
    with pytest.raises(GenerationError, match="height = 40.*multiple of 16"):
        omni.generate("x", height=40)
    with pytest.raises(GenerationError, match="num_frames = 6.*4 \\* k \\+ 1"):
        omni.generate("x", num_frames=6)
