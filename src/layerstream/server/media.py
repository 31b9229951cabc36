"""Deprecated import path, kept until 0.2: outputs are encoded by `layerstream.outputs` (``encode_output``, or an
``OutputEncoding``), as bytes; base64 belongs to a response's ``b64_json`` alone. Importing this module warns."""

import base64
import warnings
from typing import Any

from layerstream.outputs import default_encoding

IMAGE_SUFFIX = ".png"
VIDEO_SUFFIX = ".mp4"

warnings.warn(
    "layerstream.server.media is deprecated and will be removed in 0.2; encode with layerstream.outputs "
    "(encode_output or OutputEncoding)",
    DeprecationWarning,
    stacklevel=2,
)


def encode_result_b64(result: Any) -> str:
    """`result` as a base64 PNG (image) or MP4 (video), as before."""
    return base64.b64encode(default_encoding(result.kind).encode(result)).decode("ascii")
