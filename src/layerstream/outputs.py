"""Outputs: a generation's frames, and the one place they are encoded (PNG, JPEG, WebP, MP4, GIF).

`encode_output` turns a `GenerationResult` into the bytes of one file, once, with whatever settings should
travel inside it written at encode time (PNG text chunks; the MP4's ``comment`` metadata); `save_output`
writes those bytes atomically. The command line saves through it, and the server keeps the bytes as they are
until the response edge (base64 only in a ``b64_json`` field), so nothing is decoded and encoded again.
"""

from __future__ import annotations

import io
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from layerstream.request import GenerationError

OutputFormat = Literal["png", "jpeg", "webp", "mp4", "gif"]
IMAGE_FORMATS = ("png", "jpeg", "webp")
VIDEO_FORMATS = ("mp4", "gif")
IMAGE_SUFFIXES = (".png",)
"""What `save_output` writes an image as, by the path's suffix ..."""
VIDEO_SUFFIXES = (".mp4", ".gif")
"""... and a video."""
DEFAULT_QUALITY = 100
"""JPEG and WebP quality when none is given (OpenAI's default output_compression)."""
SETTINGS_KEY = "layerstream"
"""The PNG text chunk holding the settings as JSON (beside ``prompt``, readable by any PNG viewer)."""


@dataclass
class GenerationResult:
    """Frames (video: [F, H, W, 3]) or images ([N, H, W, 3]) as uint8, with the run's statistics."""

    kind: str
    frames: np.ndarray
    stats: Any
    """The call's `RunStats`."""
    fps: int = 16
    """Video: the frame rate it is saved at (the request's, else the model's)."""
    raw: Any = field(default=None, repr=False)
    """The pipeline's float output before conversion to uint8, where the caller asked for it (``keep_raw=True``:
    exact comparisons); else None."""
    size_note: str | None = None
    """With an input image: how the output size was reached (``"48x32: the input image's 50x35, rounded down
    to multiples of 16"``); None without one."""

    def save(self, path: str | Path) -> Path:
        return save_output(self, path)

    def encode(self, output_format: OutputFormat, **options: Any) -> bytes:
        """This output as the bytes of one file (see `encode_output`)."""
        return encode_output(self, output_format, **options)


@dataclass(frozen=True)
class OutputEncoding:
    """How a result becomes its file: the format, JPEG/WebP quality, and the settings written inside."""

    format: OutputFormat
    quality: int | None = None
    metadata: dict[str, Any] | None = None

    def encode(self, result: GenerationResult) -> bytes:
        return encode_output(result, self.format, quality=self.quality, metadata=self.metadata)


def default_encoding(kind: str) -> OutputEncoding:
    """What the server answers when a request names no format: PNG for an image, MP4 for a video."""
    return OutputEncoding("png" if kind == "image" else "mp4")


def encode_output(
    result: GenerationResult,
    output_format: OutputFormat,
    *,
    quality: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> bytes:
    """`result` as one file of `output_format`: an image's first frame as PNG, JPEG or WebP (`quality` for the
    last two, default `DEFAULT_QUALITY`), a video as MP4 (libx264) or GIF at its frame rate. `metadata`, if
    given, is written inside: PNG text chunks (``prompt`` and the JSON under `SETTINGS_KEY`) or the MP4's
    ``comment``; JPEG, WebP and GIF carry none."""
    allowed = IMAGE_FORMATS if result.kind == "image" else VIDEO_FORMATS
    if output_format not in allowed:
        raise GenerationError(f"output format {output_format!r} is not valid for a {result.kind}; expected one of {', '.join(allowed)}")
    if result.kind == "image":
        return _encode_image(result.frames[0], output_format, quality, metadata)
    import imageio.v3 as iio

    if output_format == "gif":
        return iio.imwrite("<bytes>", result.frames, extension=".gif", duration=1000 / result.fps, loop=0)
    extra = ["-metadata", f"comment={json.dumps(metadata)}"] if metadata is not None else []
    return iio.imwrite(
        "<bytes>", _even_frames(result.frames), extension=".mp4", fps=result.fps, codec="libx264", output_params=extra
    )


def save_output(result: GenerationResult, path: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
    """Write an image as PNG and a video as MP4 or GIF, chosen by the file suffix (`metadata` as in
    `encode_output`).

    The file is written beside `path` under a temporary name and renamed into place once complete (see
    `write_atomically`): an error or Ctrl-C while writing leaves a file already at `path` as it was.
    """
    from layerstream.atomic_write import write_atomically

    path = Path(path)
    suffix = path.suffix.lower()
    allowed = IMAGE_SUFFIXES if result.kind == "image" else VIDEO_SUFFIXES
    if suffix not in allowed:
        raise GenerationError(f"output = {str(path)!r}: a {result.kind} is saved as {' or '.join(allowed)}")
    data = encode_output(result, suffix.removeprefix("."), metadata=metadata)  # type: ignore[arg-type]
    with write_atomically(path) as partial:
        _write_file(partial, data)
    return path


def _write_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def read_output_metadata(path: Path) -> dict[str, Any]:
    """The settings written into an output file (PNG or MP4) by `encode_output`."""
    if path.suffix == ".png":
        from PIL import Image

        with Image.open(path) as image:
            return json.loads(image.text[SETTINGS_KEY])
    result = subprocess.run(
        [_ffmpeg(), "-nostdin", "-loglevel", "error", "-i", str(path), "-f", "ffmetadata", "-"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    for line in result.stdout.splitlines():
        if line.startswith("comment="):
            return json.loads(_unescape_ffmetadata(line[len("comment=") :]))
    raise ValueError(f"{path.name} carries no settings")


def _encode_image(pixels: np.ndarray, output_format: str, quality: int | None, metadata: dict[str, Any] | None) -> bytes:
    from PIL import Image

    encoded = io.BytesIO()
    image = Image.fromarray(pixels)
    if output_format == "png":
        info = None
        if metadata is not None:
            from PIL.PngImagePlugin import PngInfo

            info = PngInfo()
            info.add_text("prompt", str(metadata.get("prompt", "")))
            info.add_text(SETTINGS_KEY, json.dumps(metadata))
        image.save(encoded, format="PNG", pnginfo=info)
    else:
        image.convert("RGB").save(encoded, format=output_format.upper(), quality=DEFAULT_QUALITY if quality is None else quality)
    return encoded.getvalue()


def _even_frames(frames: np.ndarray) -> np.ndarray:
    """libx264 with yuv420p needs even width and height: pad by one edge pixel where needed."""
    _, h, w, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")


def _unescape_ffmetadata(text: str) -> str:
    # ffmetadata escapes '=', ';', '#', '\\' and newlines with a backslash
    out, escaped = [], False
    for char in text:
        if escaped or char != "\\":
            out.append(char)
            escaped = False
        else:
            escaped = True
    return "".join(out)


def _ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()  # the binary the MP4 encoder itself uses
