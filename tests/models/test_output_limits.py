"""The caps every entry point applies and the sizes a loaded model can make."""

from __future__ import annotations

import pytest

from layerstream.models import load_pipeline
from layerstream.models.output_limits import (
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_SIDE_PIXELS,
    LimitViolation,
    OutputGeometry,
    check_output_caps,
    check_output_geometry,
    read_output_geometry,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_caps_need_no_model():
    assert check_output_caps(height=None, width=None, num_frames=None) == []
    assert check_output_caps(height=DEFAULT_MAX_SIDE_PIXELS, width=1, num_frames=DEFAULT_MAX_FRAMES) == []
    assert check_output_caps(height=100_000, width=0, num_frames=DEFAULT_MAX_FRAMES + 1) == [
        LimitViolation("height", 100_000, "an integer from 1 to 2048"),
        LimitViolation("width", 0, "an integer from 1 to 2048"),
        LimitViolation("num_frames", 130, "an integer from 1 to 129"),
    ]
    assert check_output_caps(height=4096, width=4096, num_frames=None, max_side_pixels=4096) == []


@pytest.mark.parametrize(
    "name, kind, geometry",
    [
        # tiny-wan's rotary table holds 64 positions: 64 tokens x 2 (patch) x 8 (VAE) = 1024 pixels, and
        # (64 - 1) latent frames x 4 + 1 = 253 frames
        ("tiny-wan", "video", OutputGeometry(size_multiple=16, frame_multiple=4, max_side_pixels=1024, max_frames=253)),
        # Flux and Qwen-Image compute their rotary embedding for any size
        ("tiny-flux", "image", OutputGeometry(size_multiple=16, frame_multiple=None, max_side_pixels=None, max_frames=None)),
        ("tiny-qwen-image", "image", OutputGeometry(size_multiple=16, frame_multiple=None, max_side_pixels=None, max_frames=None)),
    ],
)
def test_geometry_read_from_the_loaded_pipeline(name, kind, geometry):
    assert read_output_geometry(load_pipeline(name), kind) == geometry


def test_geometry_violations_say_what_the_model_can_do():
    wan = OutputGeometry(size_multiple=16, frame_multiple=4, max_side_pixels=1024, max_frames=253)
    assert check_output_geometry(wan, height=1024, width=16, num_frames=253) == []
    assert check_output_geometry(wan, height=4096, width=40, num_frames=257) == [
        LimitViolation("height", 4096, "a multiple of 16 up to 1024"),
        LimitViolation("width", 40, "a multiple of 16 up to 1024"),
        LimitViolation("num_frames", 257, "4 * k + 1 (1, 5, 9, ...) up to 253"),
    ]
    flux = OutputGeometry(size_multiple=16, frame_multiple=None, max_side_pixels=None, max_frames=None)
    assert check_output_geometry(flux, height=8192, width=24, num_frames=None) == [
        LimitViolation("width", 24, "a multiple of 16")
    ]
