"""A phone photo conditions upright: the EXIF orientation tag is applied when an input image is read, before its
size is read, for every form an edge hands in (the server's and the command line's bytes and paths, Python's PIL
images), and for the `ImageFile` a request carries between the server's ranks. What each tag means comes from the
EXIF specification, written here with numpy, not from Pillow."""

from __future__ import annotations

import io

import numpy as np
import pytest

from layerstream.models.input_image import InputImageError, image_file, read_image_file, read_input_image, size_from_image

pytestmark = pytest.mark.fast

SHOWN = {  # stored pixels -> what a viewer shows, per EXIF orientation tag
    1: lambda a: a,
    2: np.fliplr,
    3: lambda a: np.rot90(a, 2),
    4: np.flipud,
    5: lambda a: np.rot90(np.fliplr(a), 1),  # mirrored, then turned 270 degrees clockwise
    6: lambda a: np.rot90(a, -1),  # turned 90 degrees clockwise
    7: lambda a: np.rot90(np.fliplr(a), -1),  # mirrored, then turned 90 degrees clockwise
    8: lambda a: np.rot90(a, 1),  # turned 270 degrees clockwise
}


def _stored() -> np.ndarray:
    """16 x 32 pixels of eight 8x8 blocks, each its own colour: every turn and mirror moves some block."""
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [0, 255, 255], [255, 0, 255], [0, 0, 0], [255, 255, 255]])
    blocks = colours.reshape(2, 4, 1, 1, 3).repeat(8, axis=2).repeat(8, axis=3)
    return blocks.transpose(0, 2, 1, 3, 4).reshape(16, 32, 3).astype(np.uint8)


def _jpeg(pixels: np.ndarray, orientation: int) -> bytes:
    from PIL import Image

    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = orientation  # Orientation
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=100, subsampling=0, exif=exif.tobytes())  # 4:4:4: no colour bleeds
    return out.getvalue()


@pytest.mark.parametrize("orientation", sorted(SHOWN))
def test_every_orientation_tag_is_applied_for_bytes_paths_and_pil_images(orientation, tmp_path):
    from PIL import Image

    stored = _stored()
    shown = SHOWN[orientation](stored)
    data = _jpeg(stored, orientation)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    for source in (data, path, Image.open(io.BytesIO(data))):
        image = read_input_image(source)
        got = np.asarray(image).astype(int)
        assert got.shape == shown.shape, (orientation, type(source).__name__)
        assert np.abs(got - shown.astype(int)).max() < 48, (orientation, type(source).__name__)  # JPEG's loss only


def test_the_output_size_follows_the_upright_picture():
    upright = read_input_image(_jpeg(_stored(), 6))  # stored 32 wide and 16 high, shown 16 wide and 32 high
    size = size_from_image(upright.size, size_multiple=16, max_side=1024)
    assert (upright.width, upright.height) == (16, 32) and (size.width, size.height) == (16, 32)


@pytest.mark.parametrize("orientation", [1, 5, 6])
def test_an_image_file_decodes_to_exactly_the_picture_its_source_reads_as(orientation, tmp_path):
    """What crosses to another rank (the upload's bytes, or a decoded picture as PNG) is decoded there to the
    pixels rank 0 would condition on, turned as its tag says."""
    from PIL import Image

    data = _jpeg(_stored(), orientation)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    expected = np.asarray(read_input_image(data))
    uploaded = read_image_file(data)
    assert uploaded.data == data and image_file(path).data == data  # the file itself, not its pixels
    for carried in (uploaded, image_file(Image.open(io.BytesIO(data))), image_file(expected)):
        assert carried.size == (expected.shape[1], expected.shape[0])
        assert np.array_equal(np.asarray(read_input_image(carried)), expected), carried
    assert "bytes" in repr(uploaded) and len(repr(uploaded)) < 80  # never the file in a log line


def test_an_image_file_is_not_held_to_the_pixel_cap_again_where_it_runs():
    """A server may take more pixels than the default (--max-image-pixels): the file it accepted runs."""
    accepted = read_image_file(_jpeg(_stored(), 1), max_pixels=1000)  # 32 x 16 pixels
    assert read_input_image(accepted, max_pixels=100).size == (32, 16)
    with pytest.raises(InputImageError):  # the same bytes as bytes are checked
        read_input_image(accepted.data, max_pixels=100)
