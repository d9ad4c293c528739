"""Image preprocessing for Gemma 3's vision input (hmad.model.images) against transformers, and its defences.

The reference is tests/fixtures/gemma3_image_processor.npz (made by make_image_processor_reference.py with
transformers' Gemma3ImageProcessorPil, Pillow 13.0.0): every case must match it exactly (tolerance 0: the
same Pillow calls and the same float64 / float32 steps). With another Pillow than the fixture's, the JPEG
cases may be one decoded level off (libjpeg-turbo's version), so they get a tolerance of 2/255 + 1e-6 then.

Hostile bytes (random, truncated, flipped, crafted headers) must end in ImageError and nothing else, never a
DecompressionBombWarning; hypothesis runs derandomized, without its example database.
"""

from __future__ import annotations

import hashlib
import io
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import PIL
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from hmad.core.errors import HmadError
from hmad.model.images import (
    FORMATS,
    MAX_JPEG_SCANS,
    MAX_PARTS,
    ImageError,
    ImageLimits,
    PreparedImage,
    check_count,
    prepare_image,
    to_pixels,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gemma3_image_processor.npz"
REF = dict(np.load(FIXTURE))
HALF = (0.5, 0.5, 0.5)  # Gemma 3's image_mean and image_std
LIMITS = ImageLimits()
SAME_PILLOW = f"Pillow {PIL.__version__}," in str(REF["versions"])


def _bytes(name: str) -> bytes:
    return REF[f"bytes_{name}"].tobytes()


def _prepare(data: bytes, size: int = 32, limits: ImageLimits = LIMITS, index: int = 1) -> PreparedImage:
    return prepare_image(data, size, HALF, HALF, limits, index)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def _error(data: bytes, limits: ImageLimits = LIMITS, index: int = 1) -> str:
    with pytest.raises(ImageError) as e:
        _prepare(data, limits=limits, index=index)
    return str(e.value)


def _png(width: int, height: int, idat: bytes = b"\x00" * 16, color_type: int = 2) -> bytes:
    """A PNG written chunk by chunk, any size in its header (valid checksums)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(idat)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def _gif(width: int, height: int, extent: tuple[int, int] | None = None) -> bytes:
    """A one-frame GIF: logical screen (width, height), its one frame ``extent`` (default: the screen)."""
    fw, fh = extent or (width, height)
    screen = struct.pack("<HHBBB", width, height, 0, 0, 0)
    frame = b"," + struct.pack("<HHHHB", 0, 0, fw, fh, 0) + b"\x02\x02\x44\x01\x00"
    return b"GIF89a" + screen + frame + b";"


def _with_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """A baseline JPEG with the size in its SOF0 header replaced."""
    out = bytearray(data)
    sof = out.find(b"\xff\xc0")
    out[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(out)


def _rgb(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# --- transformers' numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [str(n) for n in REF["names"]])
def test_matches_transformers(name):
    data = _bytes(name)
    got = _prepare(data)
    want = REF[f"pixels_{name}"]
    tol = 0.0 if SAME_PILLOW or not name.startswith("jpeg") else 2 / 255 + 1e-6
    assert got.pixels.shape == (3, 32, 32) and got.pixels.dtype == np.float32
    np.testing.assert_allclose(got.pixels, want, rtol=0, atol=tol)
    with Image.open(io.BytesIO(data)) as im:
        assert (got.width, got.height, got.format) == (*im.size, im.format)
        assert im.mode == str(REF[f"mode_{name}"])
    assert got.digest == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", [str(n) for n in REF["raw_names"]])
def test_modes_no_allowed_format_stores_match_transformers(name):
    """I (32-bit integers) and F (floats): clipped to 0..255 by Pillow's convert, as in transformers."""
    im = Image.fromarray(REF[f"raw_{name}"])
    assert im.mode == name.removeprefix("mode_")
    np.testing.assert_array_equal(to_pixels(im, 32, HALF, HALF), REF[f"pixels_{name}"])


def test_real_size_matches_transformers():
    """One image at Gemma 3's 896: a fixed sample of values, and the mean and std of all of them."""
    got = _prepare(REF["big_bytes"].tobytes(), size=896).pixels
    assert got.shape == (3, 896, 896) and got.flags.c_contiguous
    tol = 0.0 if SAME_PILLOW else 2 / 255 + 1e-6
    np.testing.assert_allclose(got.reshape(-1)[REF["big_index"]], REF["big_values"], rtol=0, atol=tol)
    assert abs(got.astype(np.float64).mean() - REF["big_mean"]) <= tol + 1e-12
    assert abs(got.astype(np.float64).std() - REF["big_std"]) <= tol + 1e-12


def test_transparency_is_composited_on_white():
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0] = 200  # red under alpha 0: invisible
    assert (_prepare(_encode(Image.fromarray(rgba, "RGBA"), "PNG")).pixels == 1.0).all()
    p = Image.fromarray(np.zeros((8, 8), np.uint8), "P")
    p.putpalette([10, 20, 30] * 256)
    assert (_prepare(_encode(p, "PNG", transparency=0)).pixels == 1.0).all()  # the one colour is transparent


def test_exif_orientation_is_not_applied():
    """As transformers' processor given Image.open: the pixels as stored (the fixture holds the numbers)."""
    got = _prepare(_bytes("jpeg_exif_rotated"))
    with Image.open(io.BytesIO(_bytes("jpeg_exif_rotated"))) as im:
        assert im.getexif()[0x0112] == 6
    assert (got.width, got.height) == (40, 24)


def test_first_frame_of_an_animation():
    red, blue = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))
    for fmt in ("GIF", "PNG", "WEBP"):
        got = _prepare(_encode(red, fmt, save_all=True, append_images=[blue], lossless=True)).pixels
        np.testing.assert_allclose(got[:, 8, 8], [1.0, -1.0, -1.0], atol=0.02, err_msg=fmt)


def test_mpo_is_a_jpeg():
    data = _encode(_rgb(16, 16), "MPO", save_all=True, append_images=[_rgb(16, 16, 1)])
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "MPO"
    assert _prepare(data).format == "JPEG"


def test_pixels_are_read_only_and_mean_std_per_channel():
    data = _encode(_rgb(10, 12), "PNG")
    got = prepare_image(data, 8, (0.1, 0.2, 0.3), (0.5, 0.25, 2.0), LIMITS)
    with pytest.raises(ValueError):
        got.pixels[0, 0, 0] = 0
    x = np.asarray(_rgb(10, 12).resize((8, 8), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
    want = ((x.astype(np.float64) / 255).astype(np.float32) - np.float32([[[0.1]], [[0.2]], [[0.3]]])) / (
        np.float32([[[0.5]], [[0.25]], [[2.0]]])
    )
    np.testing.assert_allclose(got.pixels, want, rtol=0, atol=1e-6)


def test_threads_get_the_same_pixels():
    names = [str(n) for n in REF["names"]] * 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: _prepare(_bytes(n)).pixels, names))
    for name, got in zip(names, results, strict=True):
        if SAME_PILLOW:
            np.testing.assert_array_equal(got, REF[f"pixels_{name}"])


# --- limits ---------------------------------------------------------------------------------------------


def test_byte_limit():
    data = _encode(_rgb(10, 10), "PNG")
    _prepare(data, limits=ImageLimits(max_bytes=len(data)))
    msg = _error(data, ImageLimits(max_bytes=len(data) - 1), index=3)
    n = len(data)
    assert msg == f"image 3: {n:,} bytes is over the limit of {n - 1:,} (vision.max_image_bytes)"
    assert _error(b"") == "image 1: empty (0 bytes)"


def test_pixel_limit_is_checked_on_the_header():
    data = _encode(_rgb(30, 40), "PNG")
    _prepare(data, limits=ImageLimits(max_pixels=1200))
    msg = _error(data, ImageLimits(max_pixels=1199), index=2)
    assert msg == "image 2: 40x30 pixels is over the limit of 1,199 (vision.max_image_pixels)"
    huge = _png(12000, 12000)  # header only: its data would not even fill a row
    over = "is over the limit of 50,000,000 (vision.max_image_pixels)"
    assert _error(huge) == f"image 1: 12000x12000 pixels {over}"
    for data in (_png(100000, 100000), _with_jpeg_size(_encode(_rgb(16, 16), "JPEG"), 60000, 60000)):
        assert "pixels is over the limit of 50,000,000" in _error(data)  # Pillow's own check fires first


def test_gif_frame_larger_than_its_screen():
    """A 1x1 GIF whose frame claims 65535x65535: Pillow's check on the frame's extent, an ImageError."""
    msg = _error(_gif(1, 1, extent=(65535, 65535)))
    assert msg == "image 1: 4,294,836,225 pixels is over the limit of 50,000,000 (vision.max_image_pixels)"


def test_pillow_bomb_check_follows_our_limit(monkeypatch):
    """Pillow's MAX_IMAGE_PIXELS is raised to our limit (an image we allow is not refused or warned about),
    and past it its warning is an ImageError, even with an 'always' filter in front."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _prepare(_encode(_rgb(40, 40), "PNG"), limits=ImageLimits(max_pixels=2000)).width == 40
        assert Image.MAX_IMAGE_PIXELS == 2000
        warnings.simplefilter("always")
        msg = _error(_encode(_rgb(50, 50), "PNG"), ImageLimits(max_pixels=2000))
        assert msg == "image 1: 50x50 pixels is over the limit of 2,000 (vision.max_image_pixels)"
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]


def _with_scans(n: int, garbage: bytes = b"") -> bytes:
    """A progressive 64x64 JPEG (10 scans) with its smallest scan repeated to make ``n`` scans in all, the
    repeats each after ``garbage`` (bytes libjpeg skips with a warning). libjpeg decodes every repeat."""
    data = _encode(_rgb(64, 64), "JPEG", progressive=True)
    starts = [i for i in range(len(data) - 1) if data[i : i + 2] == b"\xff\xda"] + [len(data) - 2]
    assert len(starts) == 11
    small = min((data[a:b] for a, b in zip(starts, starts[1:], strict=False)), key=len)
    return data[:-2] + (garbage + small) * (n - 10) + data[-2:]


def test_jpeg_scan_limit():
    """Each scan is a pass over the picture (a few KB of repeated scans can take minutes to decode)."""
    assert _prepare(_with_scans(MAX_JPEG_SCANS)).format == "JPEG"
    for data in (_with_scans(MAX_JPEG_SCANS + 1), _with_scans(MAX_JPEG_SCANS + 1, garbage=b"\x00\x17")):
        msg = _error(data)
        assert msg == (
            f"image 1: a JPEG of more than {MAX_JPEG_SCANS} scans (passes over the picture): "
            "its decoding time would have no bound"
        )
    assert _error(_with_scans(5000)).startswith("image 1: a JPEG of more than")


def _png_chunks(n: int) -> bytes:
    """A valid 8x8 PNG with private chunks before its data: ``n`` chunks in all."""
    png = _encode(_rgb(8, 8), "PNG")
    assert png.count(b"IDAT") == 1 and b"IHDR" in png[:16]
    private = struct.pack(">I", 0) + b"prVt" + struct.pack(">I", zlib.crc32(b"prVt"))
    return png[:33] + private * (n - 3) + png[33:]  # after IHDR; IHDR, IDAT, IEND


def _gif_blocks(comment_blocks: int, stray: int = 0) -> bytes:
    """A valid 8x8 GIF with a comment of ``comment_blocks`` 1-byte sub-blocks and ``stray`` stray bytes
    before its picture: comment_blocks + 1 + stray blocks."""
    gif = _encode(_rgb(8, 8), "GIF")
    at = 13 + (3 << ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0)  # after the screen and its palette
    assert gif[at : at + 1] == b","  # the picture
    return gif[:at] + b"!\xfe" + b"\x01a" * comment_blocks + b"\x00" + b"\x11" * stray + gif[at:]


def _jpeg_segments(comments: int, stray: int = 0) -> bytes:
    """A valid 8x8 JPEG with ``comments`` empty COM segments and ``stray`` stray bytes after its APP0."""
    jpeg = _encode(_rgb(8, 8), "JPEG")
    at = 4 + int.from_bytes(jpeg[4:6], "big")
    return jpeg[:at] + b"\xff\xfe\x00\x02" * comments + b"\x11" * stray + jpeg[at:]


def test_parts_limit():
    """Files Pillow would take seconds to minutes to open (it reads each part in Python) are refused."""
    too_many = f"more than {MAX_PARTS:,}"
    assert _prepare(_png_chunks(MAX_PARTS)).format == "PNG"
    assert (
        _error(_png_chunks(MAX_PARTS + 1))
        == f"image 1: a PNG file of {too_many} chunks: reading it would take too long"
    )
    jpeg = _encode(_rgb(8, 8), "JPEG")
    base = sum(1 for i in range(2, len(jpeg) - 1) if jpeg[i] == 0xFF and jpeg[i + 1] not in (0, 0xD9))
    assert base == 9  # APP0, 2 DQT, SOF0, 4 DHT, SOS
    assert _prepare(_jpeg_segments(MAX_PARTS - base)).format == "JPEG"
    for data in (_jpeg_segments(MAX_PARTS - base + 1), _jpeg_segments(0, stray=MAX_PARTS)):
        assert (
            _error(data)
            == f"image 1: a JPEG file of {too_many} segments (or stray bytes): reading it would take too long"
        )
    assert _prepare(_gif_blocks(MAX_PARTS - 1)).format == "GIF"
    for data in (_gif_blocks(MAX_PARTS), _gif_blocks(0, stray=MAX_PARTS)):
        assert (
            _error(data)
            == f"image 1: a GIF file of {too_many} blocks (or stray bytes): reading it would take too long"
        )


def test_check_count():
    check_count(0, LIMITS)
    check_count(8, LIMITS)
    with pytest.raises(ImageError, match=r"^9 images is over the limit of 8 per request \(vision.max_images"):
        check_count(9, LIMITS)
    with pytest.raises(ImageError, match=r"^image input is off \(vision.max_images_per_request is 0\)$"):
        check_count(1, ImageLimits(max_images=0))
    check_count(0, ImageLimits(max_images=0))


# --- what the messages say ------------------------------------------------------------------------------


def test_image_error_is_a_value_error_and_an_hmad_error():
    assert issubclass(ImageError, ValueError) and issubclass(ImageError, HmadError)


@pytest.mark.parametrize(
    "data, says",
    [
        (b"hello, world", "file (the first bytes are 68 65 6c 6c 6f 2c 20 77)"),
        (b"%PDF-1.7\n", "(the first bytes are 25 50 44 46 2d 31 2e 37; it looks like a PDF document)"),
        (b"II*\x00\x08\x00\x00\x00", "it looks like a TIFF file)"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00", "it looks like an HEIF, AVIF or MP4 file)"),
        (b"iVBORw0KGgoAAAANSUhEUg", "it looks like base64 text of a PNG file: send the decoded bytes)"),
        (b"data:image/png;base64,", "it looks like a data: URL: send the decoded bytes)"),
        (b'  <svg xmlns="http://www.w3.org/2000/svg"/>', "it looks like text (SVG, HTML or XML?))"),
    ],
)
def test_not_an_image(data, says):
    msg = _error(data, index=2)
    assert msg.startswith("image 2: not a PNG, JPEG, WebP, GIF or BMP file (") and msg.endswith(says)


@pytest.mark.parametrize("fmt", ["TIFF", "PPM", "ICO", "TGA", "PCX"])
def test_formats_pillow_reads_but_we_do_not(fmt):
    """The allow-list is Image.open's formats=: a valid file of another format Pillow knows is refused."""
    data = _encode(_rgb(8, 8), fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == fmt
    assert _error(data).startswith("image 1: not a PNG, JPEG, WebP, GIF or BMP file (the first bytes are ")


def test_truncated_files():
    png, jpeg = _encode(_rgb(40, 50), "PNG"), _encode(_rgb(40, 50), "JPEG")
    assert _error(png[:200]) == "image 1: truncated or corrupt PNG: image file is truncated"
    assert _error(jpeg[: len(jpeg) // 2]).startswith("image 1: truncated or corrupt JPEG: ")
    assert _error(jpeg[:20]) == "image 1: corrupt JPEG file: its header cannot be read"
    assert _error(_encode(_rgb(40, 50), "BMP")[:100]).startswith("image 1: truncated or corrupt BMP: ")


@pytest.mark.parametrize(
    "data, size",
    [
        (_png(0, 5), "0x5"),
        (_png(0, 0), "0x0"),
        (_gif(0, 0), "0x0"),
        (_gif(7, 0), "7x0"),
    ],
)
def test_empty_images(data, size):
    assert _error(data) == f"image 1: {size} pixels, an empty image"


def test_empty_bmp():
    bmp = _encode(_rgb(4, 4), "BMP")
    assert _error(bmp[:18] + struct.pack("<ii", 4, 0) + bmp[26:]) == "image 1: 4x0 pixels, an empty image"


# --- fuzz -----------------------------------------------------------------------------------------------


def _seeds() -> list[bytes]:
    """Small valid files of every allowed format (and modes), the fuzz's starting points."""
    im = _rgb(12, 16, 7)
    rgba = Image.fromarray(np.random.default_rng(8).integers(0, 256, (12, 16, 4), dtype=np.uint8), "RGBA")
    return [
        _encode(im, "PNG"),
        _encode(rgba, "PNG"),
        _encode(im.convert("P"), "PNG", transparency=3),
        _encode(im, "JPEG"),
        _encode(im, "JPEG", progressive=True),
        _encode(im.convert("CMYK"), "JPEG"),
        _encode(im, "GIF", save_all=True, append_images=[_rgb(12, 16, 9)]),
        _encode(im, "BMP"),
        _encode(im.convert("P"), "BMP"),
        _encode(rgba, "WEBP", lossless=True),
        _encode(im, "WEBP", quality=50),
        _png(16, 12),
    ]


SEEDS = _seeds()
FUZZ_LIMITS = ImageLimits(max_bytes=1 << 16, max_pixels=1 << 16)  # a mutated header decodes in no time


@st.composite
def _mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["cut", "flip", "splice", "zero"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if how == "cut":
            data = data[:at]
        elif how == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif how == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif data:
            data[at : at + 4] = b"\x00" * len(data[at : at + 4])
    return bytes(data)


@st.composite
def _declared(draw) -> bytes:
    """A header of each format declaring any size, valid or not, the rest of the file as it comes."""
    w, h = draw(st.integers(0, 65535)), draw(st.integers(0, 65535))
    kind = draw(st.sampled_from(["png", "gif", "bmp", "jpeg"]))
    if kind == "png":
        w = draw(st.integers(0, (1 << 32) - 1)) if draw(st.booleans()) else w
        return _png(w, h, color_type=draw(st.sampled_from([0, 2, 6])))
    if kind == "gif":
        return _gif(w, h, extent=(draw(st.integers(0, 65535)), draw(st.integers(0, 65535))))
    if kind == "bmp":
        bmp = _encode(_rgb(4, 4), "BMP")
        return bmp[:18] + struct.pack("<ii", w, draw(st.integers(-(1 << 31), (1 << 31) - 1))) + bmp[26:]
    return _with_jpeg_size(_encode(_rgb(8, 8), "JPEG"), min(w, 65535), min(h, 65535))


def _must_be_image_error(data: bytes) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            got = _prepare(data, size=8, limits=FUZZ_LIMITS)
        except ImageError as e:
            assert str(e).startswith("image 1: ")
        else:
            assert got.pixels.shape == (3, 8, 8) and np.isfinite(got.pixels).all()
            assert got.format in FORMATS and got.width * got.height <= FUZZ_LIMITS.max_pixels
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]


FUZZ = settings(max_examples=1200, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip


@FUZZ
@given(st.one_of(st.binary(max_size=512), _mutated(), _declared()))
def test_fuzz_only_image_errors(data):
    _must_be_image_error(data)
