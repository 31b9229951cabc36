"""`GenerationResult.save` writes whole files or none: a write that fails or is interrupted half-way leaves a
file at the target as it was."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest

import layerstream.outputs as outputs_module
from layerstream.omni import GenerationResult, RunStats


def _video(num_frames: int = 9) -> GenerationResult:
    frames = np.random.default_rng(0).integers(0, 256, (num_frames, 32, 48, 3), dtype=np.uint8)
    return GenerationResult(kind="video", frames=frames, stats=RunStats(0.0, [], 0, 0, 0, 0.0, 0, 0))


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_save_replaces_an_existing_file_with_the_whole_video(tmp_path, suffix):
    target = tmp_path / f"fox{suffix}"
    target.write_bytes(b"an earlier output")
    assert _video().save(target) == target
    assert iio.imread(target, index=None).shape[0] == 9
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_an_encoder_stopped_half_way_leaves_the_old_file(tmp_path, monkeypatch, error):
    def write_half_then_stop(path, data):
        path.write_bytes(data[: len(data) // 2])  # a real, partly-written file at the temporary name
        raise error

    monkeypatch.setattr(outputs_module, "_write_file", write_half_then_stop)
    target = tmp_path / "fox.mp4"
    target.write_bytes(b"an earlier output")
    with pytest.raises(type(error)):
        _video().save(target)
    assert target.read_bytes() == b"an earlier output"
    assert [p.name for p in tmp_path.iterdir()] == ["fox.mp4"]


FOXES = "\U0001f98a" * 10_000
"""A prompt at the 10,000-character cap whose settings JSON, two of them, passes 128 KiB: the most one
command-line argument may hold on Linux."""


def _settings(**changes) -> dict:
    return {"prompt": FOXES, "negative_prompt": FOXES, "seed": 7, "extra_params": {"a=b;#\\": "x\ny"}, "model": "m", **changes}


@pytest.mark.parametrize("suffix", [".mp4", ".png"])
def test_settings_past_an_argument_s_limit_travel_whole_in_the_file(tmp_path, suffix):
    import json

    settings = _settings()
    assert len(json.dumps(settings)) > 128 * 1024
    result = _video() if suffix == ".mp4" else GenerationResult(kind="image", frames=_video(1).frames, stats=None)
    result.settings = settings
    target = result.save(tmp_path / f"fox{suffix}")
    assert outputs_module.read_output_metadata(str(target)) == settings  # a str or a Path


def test_settings_too_large_for_a_file_go_as_their_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module, "MAX_EMBEDDED_SETTINGS_CHARS", 1000)
    result = _video()
    result.settings = {**_settings(), "offload_config": {"mode": "layer"}, "job_id": "video_1"}
    request_part = {k: v for k, v in result.settings.items() if k not in outputs_module.ORIGIN_KEYS}
    digest, chars = outputs_module.settings_digest(request_part)
    carried = outputs_module.read_output_metadata(result.save(tmp_path / "fox.mp4"))
    assert carried == {"model": "m", "offload_config": {"mode": "layer"}, "job_id": "video_1", "settings_sha256": digest, "settings_chars": chars}


def test_a_file_without_settings_reads_as_none_and_a_broken_one_says_so(tmp_path):
    from PIL import Image

    from layerstream.request import GenerationError

    Image.new("RGB", (8, 8)).save(tmp_path / "other.png")  # another tool's PNG
    assert outputs_module.read_output_metadata(tmp_path / "other.png") is None
    assert outputs_module.read_output_metadata(_video().save(tmp_path / "bare.mp4")) is None
    assert outputs_module.read_output_metadata(_video().save(tmp_path / "fox.gif")) is None
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    with pytest.raises(GenerationError, match="broken.mp4 is not a video"):
        outputs_module.read_output_metadata(tmp_path / "broken.mp4")


def test_an_encoder_failure_names_no_path():
    import imageio_ffmpeg

    from layerstream.request import GenerationError

    stopped = _video()
    stopped.fps = 0  # ffmpeg refuses a frame rate of 0
    with pytest.raises(GenerationError, match="the MP4 encoder") as failure:
        stopped.encode("mp4")
    assert imageio_ffmpeg.get_ffmpeg_exe() not in str(failure.value) and "/" not in str(failure.value)
