"""`Omni.generate` refuses sizes past the reach of the model's position table before it runs a step."""

from __future__ import annotations

import re

import pytest

from layerstream.omni import GenerationError, Omni


def test_size_and_frames_beyond_the_model_are_a_generation_error():
    omni = Omni("tiny-wan", device="cpu")
    steps = []
    # tiny-wan's transformer holds rotary positions for 1024 pixels per side and 253 frames; past them the
    # model failed deep inside with "view size is not compatible"
    with pytest.raises(GenerationError, match=re.escape("height = 2048 is not valid; expected a multiple of 16 up to 1024 for tiny-wan")):
        omni.generate("x", height=2048, width=2048, on_step=lambda *a: steps.append(a))
    with pytest.raises(GenerationError, match=re.escape("num_frames = 257 is not valid; expected 4 * k + 1 (1, 5, 9, ...) up to 253 for tiny-wan")):
        omni.generate("x", num_frames=257, on_step=lambda *a: steps.append(a))
    assert steps == []
    omni.close()
