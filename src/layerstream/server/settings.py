"""`ServeSettings`: the server's limits and switches, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from layerstream.errors import LayerstreamError
from layerstream.models.output_limits import DEFAULT_MAX_FRAMES, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_SIDE_PIXELS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt and its settings, far below it; an input image comes on top
# width x height x frames x steps x outputs, on a CPU device. 1e8 lets a 2048x2048 image run 23 steps, or a
# 832x480 video of 81 frames run 3: minutes on a 2-core CPU. Memory grows with one output's pixels x frames
# (outputs are made one at a time): tiny-wan at one step peaked at 1.3 GB for
# 512x512 x 9 frames, 1.4 GB for 512x512 x 33 and 2.2 GB for 1024x1024 x 9: a few GB, well within a 24 GB host.
CPU_MAX_WORK = 100_000_000
# on an accelerator the default cap lets every size and frame count run this many steps (or the model's default,
# if more): Wan 2.2's own 832x480 x 81 frames x 50 steps, and vllm-omni's clients'
ACCELERATOR_STEPS = 50
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0  # plus one denoising step, within the 30 s most orchestrators allow
MAX_SHUTDOWN_TIMEOUT_S = 86_400.0
DEFAULT_MAX_BATCH_SIZE = 1  # every request runs alone, exactly as without batching
MAX_BATCH_SIZE = 64
# long enough for requests sent together to reach the queue together, short beside any generation
DEFAULT_BATCH_WAIT_MS = 10.0
MAX_BATCH_WAIT_MS = 60_000.0
# after --shutdown-timeout, how long a stopped generation has to reach its next step boundary and answer
# before the server stops waiting for it: a SIGTERM always ends the process within the sum of the two
STOP_WAIT_SECONDS = 10.0
MAX_MODEL_NAME_CHARS = 256


class ServeSettingsError(LayerstreamError, ValueError):
    """A server setting outside what is allowed; names the setting, the value and the allowed range."""


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """How the server binds, what it lets a request ask for, and how long a stop may take."""

    host: str = DEFAULT_HOST
    """Address to bind; loopback by default so that nothing is exposed unless asked for."""
    port: int = DEFAULT_PORT
    """TCP port; 0 picks a free one (the ready line names it)."""
    max_queue: int = DEFAULT_MAX_QUEUE
    """Requests that may wait behind the running one; one more answers 429."""
    max_frames: int = DEFAULT_MAX_FRAMES
    """Largest ``num_frames`` (lowered to what the model can position)."""
    max_side_pixels: int = DEFAULT_MAX_SIDE_PIXELS
    """Largest width or height (lowered to what the model can position)."""
    max_work: int | None = None
    """Largest width x height x frames x steps x n of one request; None: from the device."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest body without an input image (413 unparsed); one that may carry an image: `image_body_bytes`."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Largest input image file (more answers 413 naming ``image``)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest input image in pixels, read from its header before decoding (more answers 413)."""
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    """Seconds a running generation may go on after SIGTERM before it is stopped at its next step."""
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    """Most queued requests of one batch shape run as one pipeline call; 1 runs every request alone."""
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS
    """Longest a request waits, from its arrival, for others to join its batch."""
    served_model_names: tuple[str, ...] = ()
    """The names a request's ``model`` may give, the first the one answers name; empty: the model as given."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ServeSettingsError(f"host = {self.host!r} is not valid; expected an address such as 127.0.0.1")
        _check_int("port", self.port, low=0, high=65535)
        _check_int("max_queue", self.max_queue, low=0, high=1_000_000)
        _check_int("max_frames", self.max_frames, low=1, high=100_000)
        _check_int("max_side_pixels", self.max_side_pixels, low=1, high=1_000_000)
        if self.max_work is not None:
            _check_int("max_work", self.max_work, low=1, high=10**15)
        _check_int("max_body_bytes", self.max_body_bytes, low=1024, high=1 << 30)
        _check_int("max_image_bytes", self.max_image_bytes, low=1024, high=1 << 30)
        _check_int("max_image_pixels", self.max_image_pixels, low=1, high=1 << 30)
        _check_number("shutdown_timeout", self.shutdown_timeout, high=MAX_SHUTDOWN_TIMEOUT_S, unit="seconds")
        _check_int("max_batch_size", self.max_batch_size, low=1, high=MAX_BATCH_SIZE)
        _check_number("batch_wait_ms", self.batch_wait_ms, high=MAX_BATCH_WAIT_MS, unit="milliseconds")
        for name in self.served_model_names:
            if not isinstance(name, str) or not 0 < len(name) <= MAX_MODEL_NAME_CHARS or not name.isprintable() or name != name.strip():
                raise ServeSettingsError(
                    f"served_model_names = {name!r} is not valid; expected printable text of 1 to {MAX_MODEL_NAME_CHARS}"
                    " characters, without spaces around it"
                )

    @property
    def image_body_bytes(self) -> int:
        """`max_body_bytes` plus the image, base64-encoded (4 characters per 3 bytes)."""
        return self.max_body_bytes + -(-self.max_image_bytes // 3) * 4


def _check_number(name: str, value: object, *, high: float, unit: str) -> None:
    # written as `not low <= value <= high` so that NaN, which fails every comparison, is refused too
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
        raise ServeSettingsError(f"{name} = {value!r} is not valid; expected {unit} from 0 to {high:g}")


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ServeSettingsError(f"{name} = {value!r} is not valid; expected an integer from {low} to {high}")
