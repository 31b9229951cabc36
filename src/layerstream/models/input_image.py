"""Input images of image-conditioned pipelines (image to video, image editing): whether a pipeline takes one
(`pipeline_image_input`), reading what a user gave, refused in one line before any pixel is decoded where the
header tells (`read_input_image`: only PNG, JPEG or WebP by their first bytes, within the caps), what a request
carries between threads and processes (`ImageFile`: the checked file's bytes), and the output size an image
leads to where the caller names none (`size_from_image`: its own, scaled to the model's largest side and rounded
down to its size multiple, as diffusers pipelines round)."""

from __future__ import annotations

import inspect
import io
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from layerstream.errors import LayerstreamError
from layerstream.models.size import GenerationSize
from layerstream.models.output_limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

if TYPE_CHECKING:
    from PIL import Image

ImageInputKind = Literal["none", "optional", "required"]
ImageSource = Union["Image.Image", str, "os.PathLike[str]", np.ndarray, bytes, "ImageFile"]

ALLOWED_FORMATS_TEXT = "PNG, JPEG or WebP"

# Pipelines whose signature gives `image` a default of None but that read it unconditionally: Qwen-Image-Edit
# takes `image.size` first thing in __call__. Matched by class name through the MRO (no diffusers import).
IMAGE_REQUIRED_PIPELINES = frozenset(
    {"QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline"}
)


class InputImageError(LayerstreamError, ValueError):
    """An input image that cannot be used: missing, not an image, empty, or larger than the caps."""

    def __init__(self, message: str, *, too_large: bool = False, unsupported_format: bool = False):
        super().__init__(message)
        self.too_large = too_large
        """True when the image is refused for its size (a server answers 413 rather than 400)."""
        self.unsupported_format = unsupported_format
        """True when the file is not PNG, JPEG or WebP by its first bytes (a server answers 415 rather than 400)."""


@dataclass(frozen=True)
class ImageFile:
    """An input image as the bytes of its checked file: what a request carries through the server's queue and
    between its ranks instead of the pixels (a 16.8 MP upload decodes to 50 MB). Every process decodes the same
    picture from it (`read_input_image`), without the caps again: they were applied where the file came in (a
    server's `--max-image-pixels` may be above the default)."""

    data: bytes = field(repr=False)
    size: tuple[int, int]
    """(width, height), upright, as decoding found it: what sizes an output without decoding it again."""

    def __repr__(self) -> str:
        return f"ImageFile({len(self.data):,} bytes, {self.size[0]}x{self.size[1]})"


def read_image_file(
    data: bytes,
    *,
    name: str = "image",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
) -> ImageFile:
    """The image file `data` as an `ImageFile`, checked as `read_input_image` checks it (decoded once, to know
    it decodes; the pixels are then dropped)."""
    picture = read_input_image(data, name=name, max_pixels=max_pixels, max_bytes=max_bytes)
    return ImageFile(bytes(data), picture.size)


def image_file(source: ImageSource, *, name: str = "image") -> ImageFile:
    """`source` as an `ImageFile`: itself if it is one; a file's bytes (or a path's) as they are; a decoded
    picture (a PIL image, an array) upright and in RGB, encoded once as PNG, which decodes to the same pixels."""
    if isinstance(source, ImageFile):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return read_image_file(bytes(source), name=name)
    if isinstance(source, (str, os.PathLike)):
        return read_image_file(_read_file(name, Path(source), DEFAULT_MAX_IMAGE_BYTES), name=f"{name} {source}")
    picture = read_input_image(source, name=name)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", compress_level=1)  # lossless either way; it crosses once
    return ImageFile(buffer.getvalue(), picture.size)


def pipeline_image_input(pipeline: Any) -> ImageInputKind:
    """Whether `pipeline` takes an input image, from the ``image`` argument of its ``__call__``: absent, with a
    default, or without one (or in `IMAGE_REQUIRED_PIPELINES`, whose default of None is not really allowed)."""
    param = inspect.signature(pipeline.__call__).parameters.get("image")
    if param is None:
        return "none"
    if param.default is inspect.Parameter.empty:
        return "required"
    if any(cls.__name__ in IMAGE_REQUIRED_PIPELINES for cls in type(pipeline).__mro__):
        return "required"
    return "optional"


def read_input_image(
    source: ImageSource,
    *,
    name: str = "image",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
) -> Image.Image:
    """`source` (a PIL image, a path to an image file, the bytes of one, an `ImageFile`, or an H x W (x 1/3/4)
    array of uint8 or floats from 0 to 1) as an RGB PIL image, or `InputImageError` naming `name` and what is
    wrong. Files are checked for size before they are read and for pixels from their header before they are
    decoded: an oversized or hostile file costs nothing. An EXIF orientation (a phone photo's) is applied first,
    as diffusers' `load_image` does: the model is conditioned on the picture the user saw."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(name, source.size, max_pixels)
        return _upright(source).convert("RGB")
    if isinstance(source, np.ndarray):
        return _from_array(name, source, max_pixels)
    if isinstance(source, ImageFile):  # checked against its caps where it came in (a server's may be larger)
        return _decode(name, source.data, max(max_pixels, source.size[0] * source.size[1]))
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_bytes:
            raise InputImageError(f"{name} is {len(data):,} bytes; expected at most {max_bytes:,}", too_large=True)
        return _decode(name, data, max_pixels)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        return _decode(f"{name} {path}", _read_file(name, path, max_bytes), max_pixels)
    raise InputImageError(
        f"{name} is a {type(source).__name__}; expected a PIL image, a path to an image file, or an array"
    )


def size_from_image(
    image_size: tuple[int, int], *, size_multiple: int, max_side: int | None, width: int | None = None,
    height: int | None = None, name: str = "image",
) -> GenerationSize:  # fmt: skip
    """The output size for an input image of `image_size` (width, height), with how it was reached as its
    `source` (said to the user). A side the caller gives is kept; a missing side follows the image's aspect
    ratio. With neither, the image's own size is used, scaled down (aspect kept) to fit `max_side` if larger, and
    rounded down to multiples of `size_multiple`, as diffusers pipelines round. An image too small to leave a
    whole multiple is refused rather than enlarged."""
    image_width, image_height = image_size
    m = size_multiple
    if width is not None and height is not None:
        return GenerationSize(height=height, width=width, source=f"{width}x{height}, as asked")
    if width is not None or height is not None:  # one side given: the other follows the image's aspect ratio
        target_w = width if width is not None else height * image_width / image_height
        target_h = height if height is not None else width * image_height / image_width
        how = f"the missing side follows the input image's {image_width}x{image_height}"
    else:
        scale = min(1.0, max_side / max(image_width, image_height)) if max_side else 1.0
        target_w, target_h = image_width * scale, image_height * scale
        how = f"the input image's {image_width}x{image_height}"
        how += f" scaled to fit {max_side} pixels per side" if scale < 1.0 else ""
    # a hair of tolerance: 100 * 0.48 may come out as 47.99999
    out_w, out_h = (math.floor(target + 1e-6) // m * m for target in (target_w, target_h))
    if out_w < m or out_h < m:
        raise InputImageError(
            f"{name} is {image_width}x{image_height} pixels; the output would be less than {m} pixels on a side "
            f"(the model's size multiple); expected an image at least {m}x{m} with a less extreme aspect ratio"
        )
    if abs(out_w - target_w) > 1e-6 or abs(out_h - target_h) > 1e-6:
        how += f", rounded down to multiples of {m}"
    return GenerationSize(height=out_h, width=out_w, source=f"{out_w}x{out_h}: {how}")


# --- reading ----------------------------------------------------------------------------------------------------


def _read_file(name: str, path: Path, max_bytes: int) -> bytes:
    path = path.expanduser()
    if not path.exists():
        raise InputImageError(f"{name} {path} does not exist")
    if not path.is_file():
        raise InputImageError(f"{name} {path} is not a file")
    size = path.stat().st_size
    if size > max_bytes:
        raise InputImageError(f"{name} {path} is {size:,} bytes; expected at most {max_bytes:,}", too_large=True)
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputImageError(f"{name} {path} cannot be read ({e.strerror or e})") from None


def image_file_format(data: bytes) -> str | None:
    """The format of the image file `data` by its magic number (PIL's "PNG", "JPEG" or "WEBP"), or None for any
    other bytes. Read before any decoder runs: these three are the only decoders a file's bytes reach, where PIL would
    pick among all of its decoders (TIFF, PSD, EPS through Ghostscript ...) by the same bytes. An MPO (a camera's
    JPEG with a second picture) is a JPEG here, and its first picture, a plain JPEG, is what is read."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _decode(name: str, data: bytes, max_pixels: int) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InputImageError(f"{name} is empty (0 bytes); expected a {ALLOWED_FORMATS_TEXT} image")
    file_format = image_file_format(data)
    if file_format is None:
        raise InputImageError(
            f"{name} is not a {ALLOWED_FORMATS_TEXT} file (its first bytes are {data[:8].hex(' ')}); "
            f"expected one of those formats", unsupported_format=True,
        )  # fmt: skip
    try:
        with warnings.catch_warnings():
            # PIL warns, then raises, on images past its own bomb limit; ours (below) is lower and is the one reported
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[file_format])  # that decoder only
            _check_pixels(name, image.size, max_pixels)  # from the header: nothing decoded yet
            image.load()
    except InputImageError:
        raise
    except Image.DecompressionBombError:
        raise InputImageError(f"{name} has too many pixels; expected at most {max_pixels:,}", too_large=True) from None
    except UnidentifiedImageError:  # its magic number, then a header its decoder cannot read
        raise InputImageError(f"{name} is not a readable {file_format} image (its header is damaged)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data past a valid header
        raise InputImageError(f"{name} is not a readable image ({type(e).__name__}: {e})") from None
    return _upright(image).convert("RGB")


def _upright(image: Image.Image) -> Image.Image:
    """`image` turned as its EXIF orientation tag says (a copy; the image itself when it has no such tag)."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)


def _check_pixels(name: str, size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InputImageError(f"{name} is {width}x{height} pixels (empty); expected at least one pixel on each side")
    if width * height > max_pixels:
        raise InputImageError(
            f"{name} is {width}x{height} = {width * height:,} pixels; expected at most {max_pixels:,}", too_large=True
        )


def _from_array(name: str, array: np.ndarray, max_pixels: int) -> Image.Image:
    from PIL import Image

    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise InputImageError(
            f"{name} is an array of shape {array.shape}; expected H x W (gray) or H x W x 3 (RGB) or x 4 (RGBA)"
        )
    _check_pixels(name, (array.shape[1], array.shape[0]), max_pixels)
    if array.dtype == np.uint8:
        pixels = array
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0.0 or array.max() > 1.0:
            raise InputImageError(f"{name} is a float array with values outside 0 to 1 (or NaN); expected 0 to 1")
        pixels = (array * 255.0).round().astype(np.uint8)
    else:
        raise InputImageError(f"{name} is an array of {array.dtype}; expected uint8 (0 to 255) or floats (0 to 1)")
    return Image.fromarray(np.ascontiguousarray(pixels)).convert("RGB")
