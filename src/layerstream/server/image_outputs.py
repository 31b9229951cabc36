"""What the image endpoints keep for ``response_format: "url"``: the newest encoded outputs, by name."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

OutputFormat = Literal["png", "jpeg", "webp"]

MEDIA_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# past either bound the oldest outputs are dropped (their URLs answer 404)
MAX_KEPT_OUTPUTS = 256
MAX_KEPT_OUTPUT_BYTES = 256 << 20


@dataclass(frozen=True)
class KeptOutput:
    data: bytes
    media_type: str


class KeptOutputs:
    """The newest outputs, at most `max_outputs` in `max_bytes` (the newest always: its URL must answer once)."""

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
