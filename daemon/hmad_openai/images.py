"""Images in request bodies -> what hmad's wire takes: the encoded file's bytes (an image part
``{"type": "image", "image": bytes}`` of a user message, or ``generate.images``).

Every API sends images inline, as base64: OpenAI's ``image_url.url`` and the Responses API's ``image_url``
as a ``data:image/...;base64,...`` URI, Anthropic's ``source`` as ``{type: base64, media_type, data}``,
Ollama's ``images`` as bare base64 strings. Remote URLs (``http(s)://``) are not fetched: the gateway makes
no requests of its own. The decoded bytes must be a file of a format the wire names (its signature:
``hmaclient.protocol.image_format``); hmad decodes them. Each problem is a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from hmaclient import protocol as P
from hmad_openai.errors import bad_request

# the media types of the formats the wire takes (a data: URI's, Anthropic's media_type)
MEDIA_TYPES = frozenset(
    {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/x-ms-bmp"}
)
_FORMATS = "PNG, JPEG, WebP, GIF or BMP"
REMOTE = "remote image URLs are not fetched (the gateway makes no requests of its own)"


def from_url(url: Any, where: str, param: str | None = None) -> bytes:
    """An image URL (OpenAI's ``image_url.url``, the Responses API's ``image_url``) -> the image's bytes.
    Only ``data:`` URIs are taken. A problem is a 400 whose message names ``where`` and whose ``param`` is
    ``param`` (the body's field; default ``where``)."""
    param = param or where
    if not isinstance(url, str):
        raise bad_request(f"{where} must be a string (a data: URI), got {_kind(url)}", param)
    if url[:8].lower().startswith(("http://", "https://")):
        raise bad_request(
            f"{where}: {REMOTE}: send the image inline as a data: URI (data:image/png;base64,...)", param
        )
    if not url[:5].lower() == "data:":
        raise bad_request(f"{where} must be a data: URI (data:image/png;base64,...), got {url[:40]!r}", param)
    head, comma, data = url[5:].partition(",")
    if not comma:
        raise bad_request(f"{where}: a data: URI has a ',' before its data", param)
    media, *params = (p.strip().lower() for p in head.split(";"))
    if "base64" not in params:
        raise bad_request(f"{where}: the data: URI must be base64 (data:image/png;base64,...)", param)
    return from_base64(data, where, media, param)


def from_base64(data: Any, where: str, media_type: str | None = None, param: str | None = None) -> bytes:
    """Base64 text (whitespace and missing padding tolerated) -> the image's bytes; ``media_type`` as the
    body declared it, if it did; ``where`` and ``param`` as for ``from_url``."""
    param = param or where
    if media_type is not None and media_type not in MEDIA_TYPES:
        raise bad_request(
            f"{where}: media type {media_type[:40]!r} is not an image hmad reads ({_FORMATS})", param
        )
    if not isinstance(data, str):
        raise bad_request(f"{where} must be base64 text, got {_kind(data)}", param)
    text = "".join(data.split())
    try:
        image = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{where}: the image is not valid base64 ({e})", param) from None
    if P.image_format(image) is None:
        what = "empty" if not image else f"{len(image)} bytes that are no {_FORMATS} file"
        raise bad_request(f"{where}: the decoded image is {what}", param)
    return image


def parts(items: list[tuple[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content from ("text", str) and ("image", bytes) items in order: a str (the texts joined
    by newlines) when there is no image, else hmad's list of parts (adjacent texts joined likewise)."""
    if all(kind == "text" for kind, _ in items):
        return "\n".join(value for _, value in items)
    out: list[dict[str, Any]] = []
    for kind, value in items:
        if kind == "text" and out and out[-1]["type"] == "text":
            out[-1]["text"] += "\n" + value
        else:
            out.append({"type": kind, kind: value})
    return out


def only_user(role: str, where: str, param: str | None = None) -> None:
    """A 400 unless ``role`` is the user's: hmad takes images in user messages only."""
    if role != "user":
        raise bad_request(f"{where}: only user messages may hold images, not {role!r} ones", param or where)


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__
