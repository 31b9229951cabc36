"""A job's output file with its settings inside: PNG text chunks, or the MP4's ``comment`` metadata.

The frames come encoded from the service (the library's one encoder, `layerstream.omni.save_output`); this
adds the settings without touching them: a PNG is decoded and saved again losslessly with text chunks, an
MP4's streams are copied by ffmpeg (``-c copy``) with the settings as its comment.
"""

from __future__ import annotations

import io
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SETTINGS_KEY = "layerstream"
"""The PNG text chunk holding the settings as JSON (beside ``prompt``, readable by any PNG viewer)."""


def write_png_with_settings(png: bytes, settings: dict[str, Any], path: Path) -> None:
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("prompt", str(settings.get("prompt", "")))
    info.add_text(SETTINGS_KEY, json.dumps(settings))
    with Image.open(io.BytesIO(png)) as image:
        image.save(path, format="PNG", pnginfo=info)


def write_mp4_with_settings(mp4: bytes, settings: dict[str, Any], path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="layerstream-job-") as folder:
        source = Path(folder) / "encoded.mp4"
        source.write_bytes(mp4)
        command = [
            _ffmpeg(), "-nostdin", "-loglevel", "error", "-y", "-i", str(source), "-map", "0", "-c", "copy",
            "-metadata", f"comment={json.dumps(settings)}", "-f", "mp4", str(path),
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)


def read_settings(path: Path) -> dict[str, Any]:
    """The settings written into an output file (PNG or MP4)."""
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
