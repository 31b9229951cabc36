"""`Omni.generate_batch`: one pipeline call for several prompts and seeds, each output its own, and the same
batch giving the same outputs; against `generate`, the same noise and outputs equal up to the last bits."""

from __future__ import annotations

import numpy as np
import pytest

from layerstream.omni import GenerationError, Omni

PROMPTS = ["a red fox", "a grey cat", "a grey cat"]
SEEDS = [1, 7, 8]


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-wan"])
def omni(request):
    omni = Omni(model=request.param)
    yield omni
    omni.close()


def _shape(omni: Omni) -> dict:
    return {"height": 32, "width": 32, "num_inference_steps": 1, **({"num_frames": 5} if omni.kind == "video" else {})}


def test_a_batch_streams_each_block_once_for_all_outputs_and_repeats_exactly(omni):
    batch = omni.generate_batch(PROMPTS, seeds=SEEDS, **_shape(omni), keep_raw=True)
    again = omni.generate_batch(PROMPTS, seeds=SEEDS, **_shape(omni), keep_raw=True)
    alone = [omni.generate(prompt, seed=seed, **_shape(omni), keep_raw=True) for prompt, seed in zip(PROMPTS, SEEDS)]
    for b, a, single in zip(batch, again, alone):
        assert b.raw.shape == single.raw.shape and b.frames.dtype == np.uint8
        assert np.array_equal(b.raw, a.raw)  # the same batch, the same seeds: the same bits
        # batched matrices may round differently in the last bits, never more
        assert np.abs(b.raw - single.raw).max() < 1e-4
    assert not np.array_equal(batch[1].raw, batch[2].raw)  # one prompt, two seeds: two outputs
    assert batch[0].stats is batch[2].stats  # one call
    # streamed once for 3 outputs (the first call of a fresh runtime also loads its first block: compare warm ones)
    assert again[0].stats.bytes_transferred == alone[0].stats.bytes_transferred


def test_bad_batches_are_refused_before_any_work(omni):
    with pytest.raises(GenerationError, match="one seed per output"):
        omni.generate_batch(PROMPTS, seeds=SEEDS[:2])
    with pytest.raises(GenerationError, match=r"seeds\[1\]"):
        omni.generate_batch(PROMPTS[:2], seeds=[1, "2"])
    with pytest.raises(GenerationError, match="height = 33"):
        omni.generate_batch(PROMPTS, seeds=SEEDS, height=33, width=32)
    for per_output in ("image", "max_side_pixels", "seed"):  # a batch's outputs differ by prompt and seed alone
        with pytest.raises(GenerationError, match=f"^{per_output} is not a generation argument"):
            omni.generate_batch(PROMPTS, seeds=SEEDS, **{per_output: 1})


def test_run_batch_takes_requests_with_n_outputs_each_and_refuses_two_shapes(omni):
    from dataclasses import replace

    from layerstream.request import GenerationRequest

    shape = _shape(omni)
    fox = GenerationRequest(prompt=PROMPTS[0], seed=SEEDS[0], **shape)
    cats = GenerationRequest(prompt=PROMPTS[1], seed=SEEDS[1], n=2, fps=8, **shape)
    batch = omni.run_batch([fox, cats], keep_raw=True)
    expected = omni.generate_batch(PROMPTS, seeds=SEEDS, **shape, keep_raw=True)
    assert [r.fps for r in batch] == [16, 8, 8]  # each output keeps its own request's frame rate
    assert all(np.array_equal(b.raw, e.raw) for b, e in zip(batch, expected))
    with pytest.raises(GenerationError, match=r"requests\[1\]\.num_inference_steps = 2 differs"):
        omni.run_batch([fox, replace(cats, num_inference_steps=2)])
    with pytest.raises(GenerationError, match="n = 2 is not valid"):
        omni.run(cats)


def test_float_outputs_are_kept_only_when_asked_for(omni):
    """A result holds its uint8 frames; the float output (four times their bytes) only with keep_raw=True."""
    shape = _shape(omni)
    assert all(r.raw is None for r in omni.generate_batch(PROMPTS, seeds=SEEDS, **shape))
    assert omni.generate(PROMPTS[0], seed=SEEDS[0], **shape).raw is None
    kept = omni.generate(PROMPTS[0], seed=SEEDS[0], **shape, keep_raw=True)
    assert kept.raw.dtype == np.float32 and kept.raw.shape == kept.frames.shape


def test_generate_takes_max_side_pixels_none_as_its_default(omni):
    default = omni.generate(PROMPTS[0], seed=1, **_shape(omni), keep_raw=True)
    given_none = omni.generate(PROMPTS[0], seed=1, max_side_pixels=None, **_shape(omni), keep_raw=True)
    assert np.array_equal(given_none.raw, default.raw)
