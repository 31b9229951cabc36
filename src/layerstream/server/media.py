"""Encoding generation results as the files a response carries (PNG for images, MP4 for video)."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

IMAGE_SUFFIX = ".png"
VIDEO_SUFFIX = ".mp4"


def encode_result_b64(result: Any) -> str:
    """`result` (an `Omni.generate` result) as a base64 PNG (image) or MP4 (video).

    Goes through `layerstream.omni.save_output`, the library's one place that knows how outputs are written
    (even-size padding for libx264, frame rate), by way of a temporary file: the video encoder writes files.
    """
    from layerstream.omni import save_output

    suffix = IMAGE_SUFFIX if result.kind == "image" else VIDEO_SUFFIX
    with tempfile.TemporaryDirectory(prefix="layerstream-serve-") as folder:
        path = save_output(result, Path(folder) / f"output{suffix}")
        return base64.b64encode(path.read_bytes()).decode("ascii")
