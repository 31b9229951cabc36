"""What the image endpoints hand back beyond inline PNG: the images in another format, and URLs to them.

`encode_image` turns one of the service's PNGs into the format a request asks for; `KeptOutputs` keeps the
newest outputs in memory, bounded by count and by bytes, for ``response_format: "url"``.
"""

from __future__ import annotations

import io
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

OutputFormat = Literal["png", "jpeg", "webp"]

MEDIA_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
DEFAULT_COMPRESSION = 100
"""JPEG and WebP quality when a request gives no output_compression: OpenAI's default."""
MAX_KEPT_OUTPUTS = 256
"""response_format 'url': how many image outputs the server keeps in memory for their URLs ..."""
MAX_KEPT_OUTPUT_BYTES = 256 << 20
"""... and in how many bytes at most: past either, the oldest are dropped (their URLs answer 404)."""


def encode_image(png: bytes, output_format: OutputFormat, compression: int | None = None) -> bytes:
    """`png` (an encoded output) as a file of `output_format`; a PNG is handed back as it is."""
    if output_format == "png":
        return png
    from PIL import Image

    quality = DEFAULT_COMPRESSION if compression is None else compression
    with Image.open(io.BytesIO(png)) as image:
        encoded = io.BytesIO()
        image.convert("RGB").save(encoded, format=output_format.upper(), quality=quality)
    return encoded.getvalue()


@dataclass(frozen=True)
class KeptOutput:
    data: bytes
    media_type: str


class KeptOutputs:
    """The newest image outputs, by name, in memory: at most `max_outputs` of them in `max_bytes`.

    The newest output is kept even if it alone is over `max_bytes`: its URL must answer at least once.
    Thread-safe: outputs are put from worker threads and read from the event loop.
    """

    def __init__(self, *, max_outputs: int = MAX_KEPT_OUTPUTS, max_bytes: int = MAX_KEPT_OUTPUT_BYTES):
        self.max_outputs = max_outputs
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._outputs: OrderedDict[str, KeptOutput] = OrderedDict()
        self._num_bytes = 0

    def put(self, data: bytes, output_format: OutputFormat) -> str:
        """Keep `data` and return the name it is found under (e.g. ``img_<hex>.png``)."""
        name = f"img_{secrets.token_hex(16)}.{output_format}"
        with self._lock:
            self._outputs[name] = KeptOutput(data, MEDIA_TYPES[output_format])
            self._num_bytes += len(data)
            while len(self._outputs) > 1 and (
                len(self._outputs) > self.max_outputs or self._num_bytes > self.max_bytes
            ):
                _, dropped = self._outputs.popitem(last=False)
                self._num_bytes -= len(dropped.data)
        return name

    def get(self, name: str) -> KeptOutput | None:
        with self._lock:
            return self._outputs.get(name)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._num_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._outputs)
