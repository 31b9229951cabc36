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
