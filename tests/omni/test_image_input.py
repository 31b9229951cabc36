"""`Omni.generate(image=...)`: image-to-video (tiny-wan-i2v) and image editing (a tiny Flux Kontext built
here), bit-identical to the resident pipeline given the same image, sized from the image, and every bad
image or missing one refused before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from layerstream.errors import LayerstreamError
from layerstream.models.input_image import InputImageError
from layerstream.models.loading import load_pipeline
from layerstream.omni import GenerationError, Omni

SELECTIONS = [["dit"], ["dit", "text_encoder"]]
PROMPT = "a red fox"
SEED = 3
FRAMES = 5
STEPS = 2


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def wan_i2v_reference():
    """The resident pipeline itself, called directly with a 48x32 image (a multiple of 16: used as it is)."""
    pipe = load_pipeline("tiny-wan-i2v")
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        image=picture(48, 32), prompt=PROMPT, height=32, width=48, num_frames=FRAMES, num_inference_steps=STEPS,
        guidance_scale=4.0, output_type="np", generator=torch.Generator("cpu").manual_seed(SEED),
    )  # fmt: skip
    return out.frames[0]


@pytest.mark.parametrize("components", SELECTIONS, ids="+".join)
def test_wan_i2v_is_bit_identical_to_the_resident_pipeline(wan_i2v_reference, components):
    omni = Omni("tiny-wan-i2v", {"mode": "layer", "components": components}, device="cpu")
    try:
        assert omni.image_input == "required"
        result = omni.generate(PROMPT, image=picture(48, 32), num_frames=FRAMES, num_inference_steps=STEPS, seed=SEED, keep_raw=True)
        assert result.raw.shape == (FRAMES, 32, 48, 3)
        assert np.array_equal(result.raw, wan_i2v_reference)
        assert result.stats.bytes_transferred > 0
        assert result.size_note == "48x32: the input image's 48x32"
        # the image encoder ran on the device, whole: it is never streamed
        assert "image_encoder" not in {c.path for c in omni.handle.plan.streamed}
        # the same image as an array
        array = np.asarray(picture(48, 32))
        again = omni.generate(PROMPT, image=array, num_frames=FRAMES, num_inference_steps=STEPS, seed=SEED, keep_raw=True)
        assert np.array_equal(again.raw, wan_i2v_reference)
    finally:
        omni.close()


@pytest.fixture(scope="module")
def wan_i2v():
    omni = Omni("tiny-wan-i2v", {"mode": "layer", "components": ["dit"]}, device="cpu")
    yield omni
    omni.close()


def test_the_output_size_follows_the_image_rounded_down_as_the_pipeline_rounds(wan_i2v, tmp_path):
    path = tmp_path / "in.png"
    picture(50, 35).save(path)
    result = wan_i2v.generate(PROMPT, image=str(path), num_frames=1, num_inference_steps=1)
    assert result.frames.shape == (1, 32, 48, 3)
    assert result.size_note == "48x32: the input image's 50x35, rounded down to multiples of 16"
    # a side the caller gives is kept; the other follows the image's aspect ratio
    result = wan_i2v.generate(PROMPT, image=picture(64, 32), width=32, num_frames=1, num_inference_steps=1)
    assert result.frames.shape == (1, 16, 32, 3)


def test_an_image_larger_than_the_model_reaches_is_scaled_to_fit():
    from layerstream.models.input_image import size_from_image

    size = size_from_image((4000, 3000), size_multiple=16, max_side=1024)
    assert (size.width, size.height) == (1024, 768)
    assert "scaled to fit 1024 pixels per side" in size.source
    assert (size_from_image((1000, 30), size_multiple=16, max_side=2048).height) == 16
    with pytest.raises(InputImageError, match="less than 16 pixels"):
        size_from_image((2000, 10), size_multiple=16, max_side=1024)


def _no_work_done(omni) -> bool:
    return omni.stats().num_transfers == 0


def test_a_missing_image_is_refused_before_any_work():
    omni = Omni("tiny-wan-i2v", {"mode": "layer", "components": ["dit"]}, device="cpu")
    try:
        with pytest.raises(GenerationError, match="image is required"):
            omni.generate(PROMPT, num_inference_steps=1)
        assert _no_work_done(omni)
    finally:
        omni.close()


def test_an_image_for_a_pipeline_that_takes_none_is_refused():
    omni = Omni("tiny-flux", {"mode": "layer", "components": ["dit"]}, device="cpu")
    try:
        assert omni.image_input == "none"
        with pytest.raises(GenerationError, match="takes no input image"):
            omni.generate(PROMPT, image=picture(32, 32), num_inference_steps=1)
        assert _no_work_done(omni)
    finally:
        omni.close()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: tmp / "missing.png", "does not exist"),
        (lambda tmp: _write(tmp / "text.png", b"not an image at all"), "is not a PNG, JPEG or WebP file"),
        (lambda tmp: _write(tmp / "empty.png", b""), "is empty"),
        (lambda tmp: _png(tmp / "huge.png", 5000, 4000), "20,000,000 pixels; expected at most 16,777,216"),
        (lambda tmp: _write(tmp / "cut.png", _png_bytes(64, 64)[:80]), "not a readable image"),
        (lambda tmp: np.zeros((0, 10, 3), np.uint8), "empty"),
        (lambda tmp: np.full((8, 8, 3), 2.0), "outside 0 to 1"),
        (lambda tmp: 42, "is a int"),
    ],
    ids=["missing", "not-an-image", "empty-file", "huge", "truncated", "zero-size-array", "bad-floats", "wrong-type"],
)
def test_bad_images_are_one_clear_error_before_any_work(wan_i2v, tmp_path, make, message):
    before = wan_i2v.stats().num_transfers
    with pytest.raises(InputImageError, match=message) as raised:
        wan_i2v.generate(PROMPT, image=make(tmp_path), num_frames=1, num_inference_steps=1)
    assert isinstance(raised.value, LayerstreamError) and isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)
    assert wan_i2v.stats().num_transfers == before


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _png_bytes(width: int, height: int) -> bytes:
    import io

    buffer = io.BytesIO()
    picture(width, height).save(buffer, format="PNG")
    return buffer.getvalue()


def _png(path, width: int, height: int):
    Image.new("L", (width, height)).save(path)  # one flat colour: a few KB on disk, refused from its header
    return path


# --- Flux Kontext, built here ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kontext_folder(tmp_path_factory):
    """A tiny FluxKontextPipeline: tiny-flux's components under the image-editing pipeline class."""
    from diffusers import FluxKontextPipeline

    from layerstream.models.tiny import build_tiny_pipeline_components

    folder = tmp_path_factory.mktemp("tiny-flux-kontext")
    FluxKontextPipeline(**build_tiny_pipeline_components("tiny-flux")).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("image_size, output_size", [((48, 32), (48, 32)), ((50, 40), (48, 32))])
def test_flux_kontext_edits_at_the_input_images_size_bit_identical_to_resident(kontext_folder, image_size, output_size):
    image = picture(*image_size)
    omni = Omni(str(kontext_folder), {"mode": "layer", "components": ["dit", "text_encoder"]}, device="cpu")
    try:
        assert omni.image_input == "optional"
        result = omni.generate(PROMPT, image=image, num_inference_steps=STEPS, seed=SEED, keep_raw=True)
    finally:
        omni.close()
    width, height = output_size
    assert result.raw.shape == (1, height, width, 3)  # not Kontext's default of 1024 x 1024
    assert result.size_note.startswith(f"{width}x{height}: ")

    # the resident pipeline, called directly: the image at the output size, max_area at it, no auto-resize
    pipe = load_pipeline(kontext_folder)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=image.resize(output_size, Image.Resampling.LANCZOS) if image.size != output_size else image,
        prompt=PROMPT, height=height, width=width, max_area=width * height, _auto_resize=False,
        num_inference_steps=STEPS, output_type="np", generator=torch.Generator("cpu").manual_seed(SEED),
    ).images  # fmt: skip
    assert np.array_equal(result.raw, expected)


def test_two_expert_image_to_video_takes_vllm_omnis_fields_and_matches_the_resident_pipeline():
    """tiny-wan22-i2v (Wan 2.2 I2V A14B's structure): both experts stream and run, with the low-noise expert's
    own guidance scale and the hand-over point given per request, bit for bit as the resident pipeline."""
    fields = dict(guidance_scale=4.0, guidance_scale_2=2.5, boundary_ratio=0.95)  # timesteps 999 | 900, 750, 500
    pipe = load_pipeline("tiny-wan22-i2v")
    pipe.set_progress_bar_config(disable=True)
    pipe.register_to_config(boundary_ratio=fields["boundary_ratio"])  # what the request's boundary_ratio sets
    expected = pipe(
        image=picture(48, 32), prompt=PROMPT, height=32, width=48, num_frames=FRAMES, num_inference_steps=4,
        guidance_scale=fields["guidance_scale"], guidance_scale_2=fields["guidance_scale_2"], output_type="np",
        generator=torch.Generator("cpu").manual_seed(SEED),
    ).frames[0]  # fmt: skip
    omni = Omni("tiny-wan22-i2v", device="cpu")
    try:
        calls = {"transformer": 0, "transformer_2": 0}
        for name in calls:
            getattr(omni.pipeline, name).register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        result = omni.generate(PROMPT, image=picture(48, 32), num_frames=FRAMES, num_inference_steps=4, seed=SEED, **fields, keep_raw=True)
        assert np.array_equal(result.raw, expected)
        assert calls["transformer"] > 0 and calls["transformer_2"] > 0  # both experts ran
        assert omni.pipeline.config.boundary_ratio == 0.9  # the model's own again after the request
        own = omni.generate(PROMPT, image=picture(48, 32), num_frames=FRAMES, num_inference_steps=4, seed=SEED, keep_raw=True)
        assert not np.array_equal(own.raw, result.raw)  # its own hand-over (999, 900 | 750, 500) makes another video
    finally:
        omni.close()
