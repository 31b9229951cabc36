"""Outputs: a generation's frames, and the one place they are encoded (PNG, JPEG, WebP, MP4, GIF): once, with
the settings that make them again written inside (`encode_output`), bytes that `save_output` writes atomically
and the server keeps as they are until the response edge, so nothing is decoded and encoded again.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from layerstream.request import GenerationError, GenerationRequest

OutputFormat = Literal["png", "jpeg", "webp", "mp4", "gif"]
IMAGE_FORMATS = ("png", "jpeg", "webp")
VIDEO_FORMATS = ("mp4", "gif")
IMAGE_SUFFIXES = (".png",)  # what `save_output` writes an image as, by the path's suffix
VIDEO_SUFFIXES = (".mp4", ".gif")
DEFAULT_QUALITY = 100
"""JPEG and WebP quality when none is given (OpenAI's default output_compression)."""
SETTINGS_KEY = "layerstream"
"""The PNG text chunk holding the settings as JSON (beside ``prompt``, readable by any PNG viewer)."""
MAX_EMBEDDED_SETTINGS_CHARS = 256 * 1024
"""Settings whose JSON is longer are written as a digest (`embedded_settings`): two 10,000-emoji prompts (some
240,000 characters, escaped) still travel whole."""
ORIGIN_KEYS = ("model", "offload_config", "job_id")
"""What a file's settings say beside the request's own: kept in the file even when those go as a digest."""


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
    settings: dict[str, Any] | None = None
    """What makes this output again (`request_settings`, with ``model`` and ``offload_config``), written into its
    file by `save` and `encode`; `Omni` fills it in, None for a result made otherwise."""

    def save(self, path: str | Path) -> Path:
        return save_output(self, path)

    def encode(self, output_format: OutputFormat, **options: Any) -> bytes:
        """This output as the bytes of one file (see `encode_output`)."""
        return encode_output(self, output_format, **options)


@dataclass(frozen=True)
class OutputEncoding:
    """How a result becomes its file: the format, JPEG/WebP quality, and the job it is for (its id is written
    inside beside the result's settings)."""

    format: OutputFormat
    quality: int | None = None
    job_id: str | None = None

    def encode(self, result: GenerationResult) -> bytes:
        metadata = {**result.settings, "job_id": self.job_id} if self.job_id and result.settings is not None else None
        return encode_output(result, self.format, quality=self.quality, metadata=metadata)


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
    last two, default `DEFAULT_QUALITY`), a video as MP4 (libx264) or GIF at its frame rate. `metadata` (default:
    the result's `settings`), if any, is written inside as `embedded_settings` gives it: PNG text chunks
    (``prompt`` and the JSON under `SETTINGS_KEY`) or the MP4's ``comment``; JPEG, WebP and GIF carry none."""
    allowed = IMAGE_FORMATS if result.kind == "image" else VIDEO_FORMATS
    if output_format not in allowed:
        raise GenerationError(f"output format {output_format!r} is not valid for a {result.kind}; expected one of {', '.join(allowed)}")
    metadata = metadata if metadata is not None else result.settings
    embedded = embedded_settings(metadata) if metadata is not None else None
    if result.kind == "image":
        return _encode_image(result.frames[0], output_format, quality, embedded)
    if output_format == "gif":
        import imageio.v3 as iio

        return iio.imwrite("<bytes>", result.frames, extension=".gif", duration=1000 / result.fps, loop=0)
    return _encode_mp4(_even_frames(result.frames), result.fps, embedded)


def request_settings(
    request: GenerationRequest, *, has_input_image: bool, model_revision: str | None, model_commit: str | None
) -> dict[str, Any]:
    """Every setting needed to make the result again, from `request` with the model's defaults filled in: what a
    job object shows as ``layerstream.settings`` and, with `ORIGIN_KEYS`, what an output file carries."""
    width, height = request.width, request.height
    return {
        "prompt": request.prompt,
        "negative_prompt": request.negative_prompt,
        "size": f"{width}x{height}" if width and height else "auto",  # auto: the pipeline picks its size
        "num_frames": request.num_frames,  # None for images, as fps
        "fps": request.fps,
        "num_inference_steps": request.num_inference_steps,
        "seed": request.seed,
        "guidance_scale": request.guidance_scale,  # None: the model's default, as the four below
        "guidance_scale_2": request.guidance_scale_2,
        "true_cfg_scale": request.true_cfg_scale,
        "boundary_ratio": request.boundary_ratio,
        "flow_shift": request.flow_shift,
        "extra_params": request.extra_params.to_dict(),  # {}: none
        "has_input_image": has_input_image,
        "model_revision": model_revision,
        "model_commit": model_commit,
    }


def embedded_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a file carries of `metadata`: all of it, or, where its JSON is over `MAX_EMBEDDED_SETTINGS_CHARS`, its
    `ORIGIN_KEYS` with ``settings_sha256`` (`settings_digest` of the rest) and ``settings_chars``; a job's record
    keeps those settings whole (its ``layerstream.settings``)."""
    if len(json.dumps(metadata)) <= MAX_EMBEDDED_SETTINGS_CHARS:
        return metadata
    settings = {key: value for key, value in metadata.items() if key not in ORIGIN_KEYS}
    digest, chars = settings_digest(settings)
    return {**{key: metadata[key] for key in ORIGIN_KEYS if key in metadata}, "settings_sha256": digest, "settings_chars": chars}


def settings_digest(settings: dict[str, Any]) -> tuple[str, int]:
    """(the SHA-256 of `settings` as canonical JSON: sorted keys, no spaces, ASCII; that JSON's length)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), len(text)


def save_output(result: GenerationResult, path: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
    """Write an image as PNG and a video as MP4 or GIF, by the file suffix (`metadata` as in `encode_output`),
    atomically (`write_atomically`): an error or Ctrl-C while writing leaves a file already at `path` as it was."""
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


def read_output_metadata(path: str | Path) -> dict[str, Any] | None:
    """The settings written into an output file by `encode_output` (a PNG's or an MP4's), or None where the file
    carries none (made by another tool, or a JPEG, WebP or GIF). A file that is not a PNG or a video it can read
    is a `GenerationError` naming it."""
    path = Path(path)
    if path.suffix.lower() == ".png":
        from PIL import Image

        with Image.open(path) as image:
            text = image.text.get(SETTINGS_KEY)
        return json.loads(text) if text is not None else None
    if path.suffix.lower() not in (".mp4", ".mov", ".m4v"):
        return None  # JPEG, WebP and GIF outputs carry no settings
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    found = subprocess.run(
        [_ffmpeg(), "-nostdin", "-loglevel", "error", "-i", str(path), "-f", "ffmetadata", "-"], capture_output=True, text=True
    )
    if found.returncode != 0:
        raise GenerationError(f"{path.name} is not a video ffmpeg can read: {_last_line(found.stderr)}")
    for line in found.stdout.splitlines():
        if line.startswith("comment="):
            return json.loads(_unescape_ffmetadata(line[len("comment=") :]))
    return None


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


def _encode_mp4(frames: np.ndarray, fps: int, metadata: dict[str, Any] | None) -> bytes:
    """H.264 in MP4 as imageio writes it (yuv420p, default quality, sides scaled up to multiples of 16), the metadata
    read from a file: a command-line argument is capped at 128 KiB."""
    _, h, w, _ = frames.shape
    scaled_w, scaled_h = -(-w // 16) * 16, -(-h // 16) * 16
    with tempfile.TemporaryDirectory(prefix="layerstream-mp4-") as folder:
        target = Path(folder) / "out.mp4"
        size = f"{w}x{h}"
        command = [_ffmpeg(), "-y", "-nostdin", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", size, "-r", str(fps), "-i", "-"]
        if metadata is not None:
            settings_file = Path(folder) / "settings.txt"
            settings_file.write_text(";FFMETADATA1\ncomment=" + _escape_ffmetadata(json.dumps(metadata)) + "\n")
            command += ["-f", "ffmetadata", "-i", str(settings_file), "-map", "0:v", "-map_metadata", "1"]
        if (scaled_w, scaled_h) != (w, h):
            command += ["-vf", f"scale={scaled_w}:{scaled_h}"]
        command += ["-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-loglevel", "error", str(target)]
        done = subprocess.run(command, input=np.ascontiguousarray(frames).tobytes(), capture_output=True)
        if done.returncode != 0:  # its message names no path: it reaches job records and clients
            message = _last_line(done.stderr.decode(errors="replace")).replace(folder, "<temporary folder>")
            raise GenerationError(f"the MP4 encoder (ffmpeg) failed: {message}")
        return target.read_bytes()


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def _escape_ffmetadata(text: str) -> str:
    return "".join("\\" + char if char in "=;#\\\n" else char for char in text)


def _unescape_ffmetadata(text: str) -> str:
    # ffmetadata escapes '=', ';', '#', '\\' and newlines; a lone trailing backslash escapes nothing: dropped
    return re.sub(r"\\(.)|\\$", lambda m: m.group(1) or "", text, flags=re.DOTALL)


def _ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()  # the binary the MP4 encoder itself uses
