"""Images for Gemma 3's vision input: a file's bytes -> (3, size, size) float32, as transformers makes them.

:func:`prepare_image` runs transformers' Gemma 3 image processor (5.24: ``Gemma3ImageProcessor``, whose
PIL/numpy backend is ``Gemma3ImageProcessorPil``) with Gemma 3's settings, on the image ``PIL.Image.open``
gives for the bytes, step by step (tests/test_images.py holds it to transformers' own output, bit for bit):

1. to RGB (transformers' ``convert_to_rgb``): an image with an alpha band ("A" in its bands: RGBA, LA, PA)
   or a transparency key (P with tRNS or a GIF transparent index; L, RGB or I;16 with a tRNS colour) is
   converted to RGBA and alpha-composited onto opaque white; any other mode is ``convert("RGB")``: 1 and L
   replicated, CMYK by Pillow's plain formula (no ICC profile), I;16, I and F clipped to 0..255, not scaled
   (a 16-bit PNG comes out mostly white, as in transformers);
2. resize to (size, size) with ``Image.resize(BILINEAR)`` (``reducing_gap`` None) on the RGB image: the
   aspect ratio is not kept;
3. rescale: float64 x 1/255, stored as float32;
4. normalize: (x - mean) / std per channel in float32 (Gemma 3: mean = std = 0.5, so values in [-1, 1]);
5. channels first.

Not done, as the processor does not: pan-and-scan (``do_pan_and_scan`` is off in Gemma 3's config); EXIF
orientation (the pixels are taken as stored: a phone photo tagged "rotate 90" reaches the model sideways,
as it does transformers' processor given ``Image.open``; transformers' ``load_image``, which the processor
uses only for URLs, paths and base64 strings, would rotate it and drop alpha instead of compositing it);
ICC colour profiles. Of an animation (GIF, APNG, WebP, MPO) only the first frame is used.

Hostile bytes end in :class:`ImageError` (a ValueError: the daemon answers ``bad_request`` with its message),
never another exception, and nothing is decoded before the limits allow it: the byte count first, then
what decides the time to read the file (a JPEG's scans, and the segments, chunks or blocks Pillow steps
through in Python: MAX_JPEG_SCANS, MAX_PARTS), then the size the header declares (after ``Image.open``,
which parses only headers, before ``Image.load``). Pillow's own defences stay on: an explicit ``formats=``
allow-list (and only those formats' plugins imported), truncated files refused
(``ImageFile.LOAD_TRUNCATED_IMAGES`` left false), and its decompression-bomb check
(``Image.MAX_IMAGE_PIXELS``, also applied to GIF frame extents): raised to our limit when lower, never
lowered, its warning made an error so that a bomb is an ImageError, never a warning on stderr.

Thread-safe: each call has its own image objects; the one shared setting is changed under a lock.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import (  # noqa: F401 - imported to register them: the allowed formats' readers, and no others
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    JpegImagePlugin,
    MpoImagePlugin,
    PngImagePlugin,
    WebPImagePlugin,
)

from hmad.core.errors import HmadError

#: the formats Image.open may try, in Pillow's names (a JPEG with more pictures opens as Pillow's MPO)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_ALLOWED = "a PNG, JPEG, WebP, GIF or BMP file"
RESCALE = 1 / 255  # Gemma 3's rescale_factor
#: scans (passes over the whole picture) a JPEG may have: each costs a pass and libjpeg takes a repeated one
#: as a mere warning, so scans decide the decoding time; encoders write 1 to a few tens (libjpeg's
#: progressive default: 10), libjpeg-turbo's own fuzzing stops at 500
MAX_JPEG_SCANS = 100
#: segments (JPEG), chunks (PNG) or blocks (GIF, before its first picture) a file may have, stray bytes
#: counted as one each: Pillow reads them one by one in Python, so their number decides the time to open a
#: file; encoders write tens (a PNG's data in chunks of 8 KiB or more: 2,560 in 20 MiB)
MAX_PARTS = 10_000


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (the config's ``vision`` section)."""

    max_bytes: int = 20 << 20  # of one image's file
    max_pixels: int = 50_000_000  # width x height its header declares
    max_images: int = 8  # per request; 0: image input refused


class ImageError(HmadError, ValueError):
    """An image the daemon refuses; the message says which one (1-based) and what is wrong with it."""


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image ready for the vision tower."""

    pixels: np.ndarray  # (3, size, size) float32, read-only
    digest: str  # sha256 hex of the file's bytes
    width: int  # as stored (before the resize)
    height: int
    format: str  # one of FORMATS


def check_count(n: int, limits: ImageLimits) -> None:
    """Raise ImageError when a request carries more than ``limits.max_images`` images."""
    if n > 0 and limits.max_images == 0:
        raise ImageError("image input is off (vision.max_images_per_request is 0)")
    if n > limits.max_images:
        raise ImageError(
            f"{n} images is over the limit of {limits.max_images} per request (vision.max_images_per_request)"
        )


def prepare_image(
    data: bytes, size: int, mean: Sequence[float], std: Sequence[float], limits: ImageLimits, index: int = 1
) -> PreparedImage:
    """The pixels of the image file ``data`` as Gemma 3 sees them (the module's docstring: how, bit for bit as
    transformers), resized to (size, size) and normalized with ``mean`` and ``std`` (3 values each).
    ``index`` (1-based) names the image in errors. Raises ImageError for anything it cannot or may not use."""
    where = f"image {index}"
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{where}: {len(data):,} bytes is over the limit of {limits.max_bytes:,} (vision.max_image_bytes)"
        )
    if not data:
        raise ImageError(f"{where}: empty (0 bytes)")
    with _opened(data, limits, where) as im:
        fmt = "JPEG" if im.format == "MPO" else str(im.format)
        width, height = im.size
        _load(im, fmt, where)
        rgb = _pillow_call(lambda: resized_rgb(im, size), f"{where}: cannot convert this {fmt} to RGB")
    pixels = normalized(rgb, mean, std)
    pixels.flags.writeable = False
    return PreparedImage(pixels, hashlib.sha256(data).hexdigest(), width, height, fmt)


def to_pixels(im: Image.Image, size: int, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(3, size, size) float32 of a PIL image: to RGB, bilinear resize, rescale, normalize (transformers')."""
    return normalized(resized_rgb(im, size), mean, std)


def resized_rgb(im: Image.Image, size: int) -> Image.Image:
    """The RGB image (to_rgb) resized to (size, size): bilinear, reducing_gap None, as transformers."""
    return to_rgb(im).resize((size, size), Image.Resampling.BILINEAR)


def normalized(rgb: Image.Image, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(3, H, W) float32 of an RGB image: x / 255 (in float64), then (x - mean) / std in float32."""
    chw = np.asarray(rgb).transpose(2, 0, 1)  # (H, W, 3) uint8 -> (3, H, W)
    x = (chw.astype(np.float64) * RESCALE).astype(np.float32)  # transformers' rescale: in float64
    m = np.asarray(mean, np.float32).reshape(3, 1, 1)
    s = np.asarray(std, np.float32).reshape(3, 1, 1)
    return np.ascontiguousarray((x - m) / s)


def to_rgb(im: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, every other mode convert("RGB").
    Where transformers converts to the mode the image is in already (a copy), the image itself is used."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im if im.mode == "RGBA" else im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        composed = Image.alpha_composite(white, rgba)
        del white, rgba  # freed before the RGB copy is made: one full-size image less at the peak
        return composed.convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


# --- opening and decoding -------------------------------------------------------------------------------


def _opened(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """The image of ``data`` with its header read and its declared size checked; nothing decoded yet."""
    _guard_pillow(limits.max_pixels)
    _check_parts(data, where)
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.UnidentifiedImageError:
        raise _unidentified(data, where) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _over_pixels(where, _bomb_pixels(e), limits, _declared_size(data, _sniff(data))) from None
    except Exception as e:  # a plugin's parse of a hostile header: any error is the file's
        raise ImageError(f"{where}: corrupt {_sniff(data) or 'image'} file: {_reason(e)}") from None
    width, height = im.size
    if width < 1 or height < 1:
        im.close()
        raise ImageError(f"{where}: {width}x{height} pixels, an empty image")
    if width * height > limits.max_pixels:
        im.close()
        raise _over_pixels(where, width * height, limits, (width, height))
    return im


def _load(im: Image.Image, fmt: str, where: str) -> None:
    """Decode the first frame (Image.open's); a short or broken stream is an ImageError."""
    _pillow_call(im.load, f"{where}: truncated or corrupt {fmt}")


def _pillow_call(fn, what: str):
    """``fn()``; any exception of Pillow on hostile data becomes ImageError(``what: <Pillow's reason>``)."""
    try:
        return fn()
    except MemoryError:
        raise ImageError(f"{what}: out of memory") from None
    except Exception as e:
        raise ImageError(f"{what}: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """Pillow's words for ``e`` on one line, at most 200 characters; an unusual exception is named."""
    text = " ".join(str(e).split())[:200]
    if text and isinstance(e, OSError | SyntaxError | ValueError | EOFError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_pillow_lock = threading.Lock()
_BOMB_FILTER = ("error", None, Image.DecompressionBombWarning, None, 0)  # warnings.filters' entry


def _guard_pillow(max_pixels: int) -> None:
    """Pillow's bomb check must not refuse what ``max_pixels`` allows, and must raise, not warn, past it.

    Image.MAX_IMAGE_PIXELS (Pillow warns above it, raises above twice it) is raised to ``max_pixels`` when
    lower and never lowered (it is Pillow's process-wide setting); the warning is made an error by a filter
    kept first in warnings.filters (checked on each call: ``warnings.catch_warnings``, as pytest uses
    around every test, restores the list it saved)."""
    with _pillow_lock:
        if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
            Image.MAX_IMAGE_PIXELS = max_pixels
        if not warnings.filters or warnings.filters[0] != _BOMB_FILTER:
            warnings.simplefilter("error", Image.DecompressionBombWarning)


def _bomb_pixels(e: Exception) -> int | None:
    m = re.search(r"\((\d+) pixels\)", str(e))
    return int(m.group(1)) if m else None


def _over_pixels(
    where: str, pixels: int | None, limits: ImageLimits, dims: tuple[int, int] | None = None
) -> ImageError:
    """The error of an image over the pixel limit: its width x height when known (``dims``, if they make
    ``pixels``: a GIF frame's extent is not its header's size), else the count Pillow refused."""
    if dims is not None and (pixels is None or dims[0] * dims[1] == pixels):
        what = f"{dims[0]}x{dims[1]}"
    else:
        what = f"{pixels:,}" if pixels is not None else "more than the limit's"
    return ImageError(
        f"{where}: {what} pixels is over the limit of {limits.max_pixels:,} (vision.max_image_pixels)"
    )


# --- the parts Pillow reads one by one --------------------------------------------------------------------


def _check_parts(data: bytes, where: str) -> None:
    """Refuse, before Pillow reads it, a file whose reading time has no bound: a JPEG of more than
    MAX_JPEG_SCANS scans, a JPEG, PNG or GIF of more than MAX_PARTS parts (MAX_PARTS: which)."""
    fmt = _sniff(data)
    if fmt == "JPEG":
        parts, scans = _jpeg_parts(data, MAX_PARTS + 1)
        if scans > MAX_JPEG_SCANS:
            raise ImageError(
                f"{where}: a JPEG of more than {MAX_JPEG_SCANS} scans (passes over the picture): "
                "its decoding time would have no bound"
            )
    elif fmt == "PNG":
        parts = _png_chunks(data, MAX_PARTS + 1)
    elif fmt == "GIF":
        parts = _gif_blocks(data, MAX_PARTS + 1)
    else:
        return
    if parts > MAX_PARTS:
        what = {"JPEG": "segments (or stray bytes)", "PNG": "chunks", "GIF": "blocks (or stray bytes)"}[fmt]
        raise ImageError(
            f"{where}: a {fmt} file of more than {MAX_PARTS:,} {what}: reading it would take too long"
        )


#: the next marker as libjpeg finds it: an FF not followed by a stuffed 00, an RSTn or another FF (fill)
_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")


def _jpeg_parts(data: bytes, stop: int) -> tuple[int, int]:
    """(segments and stray bytes, scans) of a JPEG's first picture, counted until either is past its limit.

    Walked as libjpeg walks it: a segment's length skips its body (an embedded thumbnail is inside an APP
    segment), anything else up to the next marker is skipped (a scan's entropy-coded data, and stray bytes,
    which libjpeg only warns about and Pillow steps over one by one), and EOI ends it (an MPO's later
    pictures follow it)."""
    parts = scans = 0
    pos, in_scan = 2, False  # after SOI
    while parts < stop and scans <= MAX_JPEG_SCANS:
        found = _MARKER.search(data, pos)
        if found is None or found.start() + 4 > len(data):
            break
        parts += 1 + (0 if in_scan else found.start() - pos)
        pos, kind = found.start(), data[found.start() + 1]
        if kind == 0xD9:  # EOI
            break
        if kind in (0x01, 0xD8):  # TEM, SOI: no length
            pos, in_scan = pos + 2, False
            continue
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        in_scan = kind == 0xDA
        scans += in_scan
    return parts, scans


def _png_chunks(data: bytes, stop: int) -> int:
    """The chunks of a PNG, counted up to ``stop`` (or to IEND, or to where the file ends)."""
    n, pos = 0, 8  # after the signature
    while n < stop and pos + 8 <= len(data):
        n += 1
        if data[pos + 4 : pos + 8] == b"IEND":
            break
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")  # length, type, body, CRC
    return n


def _gif_blocks(data: bytes, stop: int) -> int:
    """The blocks before a GIF's first picture (extensions and their sub-blocks, stray bytes one each),
    counted up to ``stop``: what Pillow's open steps through."""
    flags = data[10] if len(data) > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the screen and its palette
    n = 0
    while n < stop and pos < len(data) and data[pos] not in b",;":  # a picture, the end
        n, pos = n + 1, pos + 1
        if data[pos - 1] == 0x21:  # "!": an extension: its label, then sub-blocks up to an empty one
            pos += 1
            while n < stop and pos < len(data) and data[pos]:
                n, pos = n + 1, pos + 1 + data[pos]
            pos += 1
    return n


# --- what a file is, for the messages ---------------------------------------------------------------------

_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
#: first bytes of files people send by mistake -> what to tell them
_OTHERS = (
    (b"II*\x00", "a TIFF file"),
    (b"MM\x00*", "a TIFF file"),
    (b"%PDF", "a PDF document"),
    (b"\x00\x00\x01\x00", "an ICO file"),
    (b"\xff\x0a", "a JPEG XL file"),
    (b"\x00\x00\x00\x0cJXL ", "a JPEG XL file"),
    (b"iVBORw0KGgo", "base64 text of a PNG file: send the decoded bytes"),
    (b"/9j/", "base64 text of a JPEG file: send the decoded bytes"),
    (b"data:", "a data: URL: send the decoded bytes"),
    (b"<", "text (SVG, HTML or XML?)"),
)


def _sniff(data: bytes) -> str | None:
    """The allowed format ``data`` starts like, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for sig, fmt in _SIGNATURES if data.startswith(sig)), None)


def _unidentified(data: bytes, where: str) -> ImageError:
    """Image.open recognised no allowed format: say what the bytes look like."""
    fmt = _sniff(data)
    if fmt is None:
        head = data.lstrip()[:16]
        looks = next((f"; it looks like {what}" for sig, what in _OTHERS if head.startswith(sig)), "")
        if head[4:8] == b"ftyp":
            looks = "; it looks like an HEIF, AVIF or MP4 file"
        return ImageError(f"{where}: not {_ALLOWED} (the first bytes are {data[:8].hex(' ')}{looks})")
    dims = _declared_size(data, fmt)
    if dims is not None and min(dims) < 1:
        return ImageError(f"{where}: {dims[0]}x{dims[1]} pixels, an empty image")
    return ImageError(f"{where}: corrupt {fmt} file: its header cannot be read")


def _declared_size(data: bytes, fmt: str | None) -> tuple[int, int] | None:
    """(width, height) in a PNG, GIF or BMP header (None: another format, or too short)."""
    try:
        if fmt == "PNG" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if fmt == "GIF":
            return struct.unpack("<HH", data[6:10])
        if fmt == "BMP":
            if struct.unpack("<I", data[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER
                return struct.unpack("<HH", data[18:22])
            w, h = struct.unpack("<ii", data[18:26])
            return w, abs(h)  # a negative height: rows stored top-down
    except struct.error:
        pass
    return None
