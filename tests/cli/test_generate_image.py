"""`layerstream generate --image PATH`: image to video with tiny-wan-i2v, bit-identical to resident, and every
bad --image one line with exit code 2 (before the model loads when the file alone tells). One image to video
runs as a subprocess, as a user runs it; the rest through `main` in this process (`layerstream_cli`), where an
error line is all of stderr just the same (test_generate_cli keeps generate's errors in a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from layerstream.outputs import read_output_metadata


def generate(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "layerstream", "generate", *args],
        capture_output=True, text=True, cwd=cwd, env=dict(os.environ), timeout=timeout,
    )  # fmt: skip


def _image(path, width, height):
    pixels = (np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.mark.parametrize("components", [["dit"], ["dit", "text_encoder"]], ids="+".join)
def test_image_to_video_matches_resident_and_takes_the_images_size(tmp_path, layerstream_cli, components):
    image = _image(tmp_path / "in.png", 50, 35)
    config = json.dumps({"mode": "layer", "components": components})
    run = generate if components == ["dit"] else lambda *args: layerstream_cli("generate", *args)
    result = run(
        "--model", "tiny-wan-i2v", "--image", image, "--steps", "2", "--num-frames", "5", "--compare-resident",
        "--diffusion-offload-config", config, "--output", str(tmp_path / "out.mp4"), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["identical_to_resident"] is True
    assert (summary["width"], summary["height"], summary["num_frames"]) == (48, 32, 5)
    assert summary["image"] == image
    assert summary["size_note"] == "48x32: the input image's 50x35, rounded down to multiples of 16"
    # the file carries what makes it again, as a job's does: the size the image set, the model, the config
    settings = read_output_metadata(tmp_path / "out.mp4")
    made = (settings["size"], settings["num_frames"], settings["num_inference_steps"], settings["has_input_image"])
    assert made == ("48x32", 5, 2, True) and settings["model"] == "tiny-wan-i2v"
    assert settings["offload_config"]["components"] == components


def _error_line(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerstream: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: str(tmp / "missing.png"), "does not exist"),
        (lambda tmp: _write(tmp / "notes.png", b"these are notes"), "is not a PNG, JPEG or WebP file"),
        (lambda tmp: _write(tmp / "empty.png", b""), "is empty (0 bytes)"),
        (lambda tmp: _flat_png(tmp / "huge.png", 5000, 4000), "20,000,000 pixels; expected at most"),
        (lambda tmp: str(tmp), "is not a file"),
    ],
    ids=["missing", "not-an-image", "empty", "huge", "folder"],
)
def test_a_bad_image_is_one_line_and_exit_2(tmp_path, layerstream_cli, make, message):
    path = make(tmp_path)
    line = _error_line(layerstream_cli("generate", "--model", "tiny-wan-i2v", "--image", path, "--output", str(tmp_path / "o.mp4")))
    assert line.startswith("layerstream: error: --image ") and message in line


def test_a_model_that_needs_an_image_and_gets_none_is_exit_2(tmp_path, layerstream_cli):
    # (an image for a model that takes none is refused the same way; Omni's tests cover that case)
    line = _error_line(layerstream_cli("generate", "--model", "tiny-wan-i2v", "--output", str(tmp_path / "o.mp4")))
    assert "generates from an input image; pass --image PATH" in line


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _flat_png(path, width, height) -> str:
    Image.new("L", (width, height)).save(path)  # a few KB: refused from its header, never decoded
    return str(path)
