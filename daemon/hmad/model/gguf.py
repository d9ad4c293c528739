"""GGUF files → metadata and memory-mapped weight tensors, validated before anything trusts them.

Layout (GGUF v2/v3, little-endian)::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count × (key string | value_type u32 | value)          string = u64 length + UTF-8 bytes
                                                             array  = item_type u32 + count u64 + items
    tensor_count × (name string | n_dims u32 | ne u64[n_dims] | ggml_type u32 | offset u64)
    padding to `general.alignment` (default 32) | tensor data (each offset relative to here, aligned)

Why not ``gguf.GGUFReader``: it walks every array item in Python with a numpy view apiece (19 s for the
270M model's 262144-token vocab on 2 cores) and trusts declared lengths, so a corrupt count can make it loop
or allocate without bound. This reader checks every length against :data:`LIMITS` and the file size before
reading, makes numeric arrays with one ``np.frombuffer``, and never reads tensor data: tensors are views of a
read-only ``mmap`` (a 26 GB file costs page-table entries, not RAM). A parts manifest (hmad.model.parts: one
GGUF stored as several files, as the embedded model is) is read the same way, its parts mapped side by side.

Any corrupt or unsupported input raises :class:`ModelFormatError` naming the file and the problem.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from hmad.core.errors import ModelFormatError
from hmad.core.quants import SUPPORTED_TYPES, row_bytes
from hmad.core.tensors import PLAIN_TYPES, QType, WeightTensor
from hmad.model import parts

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Limits: far above any real model (Gemma 3 27B: ~800 tensors, ~40 keys, a 262144-token vocab, a few-KiB
# chat template), low enough that a corrupt header fails at once instead of looping or allocating.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_NAME_BYTES = 65535  # keys and tensor names (the GGUF spec's key limit)
MAX_STRING_BYTES = 1 << 20  # one string value or array item
MAX_ARRAY_ITEMS = 1 << 24  # items in one metadata array
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20
INT64_MAX = (1 << 63) - 1

LIMITS = {
    "tensors": MAX_TENSORS,
    "kv": MAX_KV,
    "name_bytes": MAX_NAME_BYTES,
    "string_bytes": MAX_STRING_BYTES,
    "array_items": MAX_ARRAY_ITEMS,
    "dims": MAX_DIMS,
    "alignment": MAX_ALIGNMENT,
}

# struct codes of the scalar value types (arrays of them are read as numpy '<' + code).
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "B",  # any non-zero byte is true
}


@dataclass
class GGUFFile:
    """A parsed GGUF file.

    ``metadata`` maps each key to a plain value: ``str``, ``int``, ``float`` (float32 values widened),
    ``bool``; arrays of strings are ``list[str]``; arrays of numbers or bools are 1-D numpy arrays of the
    stored type (e.g. ``tokenizer.ggml.scores`` float32, ``tokenizer.ggml.token_type`` int32), copied out
    of the file.
    ``tensors`` maps names to :class:`WeightTensor` whose ``shape`` is numpy order (GGUF's ``ne`` reversed)
    and whose ``data`` is a read-only view of the file's mmap (of its parts' mapping, for a manifest).
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, WeightTensor]
    version: int = 3
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0  # absolute file offset of the tensor data section


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate ``path`` (a GGUF file or a parts manifest); tensor data stays on disk, mapped.
    Raises ModelFormatError only (ModelNotFoundError too for a manifest's missing part)."""
    path = os.fspath(path)
    buf = _map_file(path)
    try:
        return _parse(_Cursor(buf, path))
    except ModelFormatError:
        raise
    except Exception as e:  # a safety net: every known problem is checked and named above this
        raise ModelFormatError(path, f"unreadable GGUF ({type(e).__name__}: {e})") from e


def require(gguf_file: GGUFFile, key: str, kind: type) -> Any:
    """``metadata[key]``, checked to be a ``kind``; ModelFormatError naming the key if missing or mistyped.

    ``int`` does not accept bools; ``float`` accepts ints (returned as float); ``list`` is a string array,
    ``np.ndarray`` a numeric one.
    """
    if key not in gguf_file.metadata:
        raise ModelFormatError(gguf_file.path, f"missing metadata key {key!r}")
    return _checked(gguf_file, key, kind)


def optional(gguf_file: GGUFFile, key: str, kind: type, default: Any = None) -> Any:
    """Like :func:`require`, but ``default`` when the key is absent (a mistyped value still fails)."""
    if key not in gguf_file.metadata:
        return default
    return _checked(gguf_file, key, kind)


def require_tensors(gguf_file: GGUFFile, names: list[str] | tuple[str, ...]) -> None:
    """ModelFormatError listing every name in ``names`` the file lacks (the first 20, then a count)."""
    missing = [n for n in names if n not in gguf_file.tensors]
    if missing:
        shown = ", ".join(missing[:20]) + (f", … ({len(missing) - 20} more)" if len(missing) > 20 else "")
        raise ModelFormatError(gguf_file.path, f"missing tensors ({len(missing)} of {len(names)}): {shown}")


def _checked(gguf_file: GGUFFile, key: str, kind: type) -> Any:
    value = gguf_file.metadata[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    got = f"array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
    raise ModelFormatError(gguf_file.path, f"metadata {key!r} is {got}, expected {kind.__name__}")


# --- reading -------------------------------------------------------------------------------------------


def _map_file(path: str) -> mmap.mmap | memoryview:
    """Read-only mmap of a regular file at least a header long; for a parts manifest, its parts' mapping."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ModelFormatError(path, "not a regular file")
        if st.st_size < 24:
            raise ModelFormatError(path, f"file too short for a GGUF header ({st.st_size} bytes)")
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelFormatError(path, f"cannot open: {e.strerror or e}") from e
    if buf[: len(parts.MAGIC)] != parts.MAGIC:
        return buf
    buf.close()
    return parts.map_manifest(path)


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked little-endian reads through the header; an overrun is a 'truncated' ModelFormatError."""

    def __init__(self, buf: mmap.mmap | memoryview, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def take(self, n: int, what: str) -> int:
        """Advance over ``n`` bytes; returns where they start."""
        if self.pos + n > self.size:
            raise self.error(
                f"truncated: {what} at byte {self.pos} needs {n} bytes, the file has {self.size}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, code: str, what: str) -> int | float:
        return struct.unpack_from("<" + code, self.buf, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("Q", f"{what} length")
        if n > limit:
            raise self.error(f"{what} declares {n} bytes, over the {limit}-byte limit")
        start = self.take(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} is not valid UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (a string array, e.g. a 262k-token vocabulary) in one tight loop;
        an item that is not well formed is read again by ``string``, which raises its precise error."""
        buf, size, out = self.buf, self.size, []
        length = _U64.unpack_from
        for i in range(count):
            pos = self.pos
            n = length(buf, pos)[0] if pos + 8 <= size else MAX_STRING_BYTES + 1
            end = pos + 8 + n
            if n > MAX_STRING_BYTES or end > size:
                self.string(f"item {i} of {what}")  # raises
            try:
                out.append(str(buf[pos + 8 : end], "utf-8"))
            except UnicodeDecodeError:
                self.string(f"item {i} of {what}")  # raises
            self.pos = end
        return out

    def numbers(self, code: str, count: int, what: str) -> np.ndarray:
        dtype = np.dtype("<" + code)
        return np.frombuffer(self.buf, dtype, count, self.take(count * dtype.itemsize, what)).copy()


def _parse(cur: _Cursor) -> GGUFFile:
    version, n_tensors, n_kv = _read_header(cur)
    metadata = _read_metadata(cur, n_kv)
    infos = _read_tensor_infos(cur, n_tensors)
    alignment = _alignment(cur, metadata)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _make_tensors(cur, infos, data_offset, alignment)
    return GGUFFile(cur.path, metadata, tensors, version, alignment, data_offset)


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    magic = bytes(cur.buf[0:4])
    if magic != MAGIC:
        raise cur.error(f"bad magic {magic!r}: not a GGUF file")
    cur.take(4, "magic")
    version = cur.scalar("I", "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise cur.error(f"unsupported GGUF version {version}{hint}; supported: {SUPPORTED_VERSIONS}")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "metadata kv count")
    if n_tensors > MAX_TENSORS:
        raise cur.error(f"tensor count {n_tensors} is over the limit of {MAX_TENSORS}")
    if n_kv > MAX_KV:
        raise cur.error(f"metadata kv count {n_kv} is over the limit of {MAX_KV}")
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}", MAX_NAME_BYTES)
        if key in metadata:
            raise cur.error(f"duplicate metadata key {key!r}")
        metadata[key] = _read_value(cur, cur.scalar("I", f"type of {key!r}"), key)
    return metadata


def _value_type(cur: _Cursor, type_id: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(type_id)
    except ValueError:
        raise cur.error(f"unknown metadata value type {type_id} for key {key!r}") from None


def _read_value(cur: _Cursor, type_id: int, key: str) -> Any:
    vtype = _value_type(cur, type_id, key)
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}")
    if vtype == GGUFValueType.ARRAY:
        return _read_array(cur, key)
    value = cur.scalar(_SCALAR_CODES[vtype], f"value of {key!r}")
    return value != 0 if vtype == GGUFValueType.BOOL else value


def _read_array(cur: _Cursor, key: str) -> list[str] | np.ndarray:
    item_type = _value_type(cur, cur.scalar("I", f"item type of {key!r}"), key)
    count = cur.scalar("Q", f"length of {key!r}")
    if count > MAX_ARRAY_ITEMS:
        raise cur.error(f"array {key!r} declares {count} items, over the limit of {MAX_ARRAY_ITEMS}")
    if item_type == GGUFValueType.ARRAY:
        raise cur.error(f"array {key!r} holds arrays; nested arrays are not supported")
    if item_type == GGUFValueType.STRING:
        return cur.strings(count, repr(key))
    items = cur.numbers(_SCALAR_CODES[item_type], count, f"items of {key!r}")
    return items != 0 if item_type == GGUFValueType.BOOL else items


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the row length
    type_id: int
    offset: int  # relative to the data section


def _read_tensor_infos(cur: _Cursor, n_tensors: int) -> list[_TensorInfo]:
    infos: list[_TensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}", MAX_NAME_BYTES)
        if name in names:
            raise cur.error(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = cur.scalar("I", f"n_dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"tensor {name!r} has n_dims {n_dims}; supported: 1 to {MAX_DIMS}")
        ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, f"dims of {name!r}"))
        type_id = cur.scalar("I", f"type of {name!r}")
        offset = cur.scalar("Q", f"offset of {name!r}")
        infos.append(_TensorInfo(name, ne, type_id, offset))
    return infos


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise cur.error(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
    return alignment


# --- tensors -------------------------------------------------------------------------------------------


def _make_tensors(
    cur: _Cursor, infos: list[_TensorInfo], data_offset: int, alignment: int
) -> dict[str, WeightTensor]:
    tensors: dict[str, WeightTensor] = {}
    spans: list[tuple[int, int, str]] = []  # (start, end, name), absolute file offsets
    for info in infos:
        qtype, shape, nbytes = _check_tensor(cur, info, alignment)
        start = data_offset + info.offset
        if start + nbytes > cur.size:
            raise cur.error(
                f"tensor {info.name!r} data (bytes {start}..{start + nbytes}) runs past the end of the file "
                f"({cur.size} bytes)"
            )
        spans.append((start, start + nbytes, info.name))
        tensors[info.name] = WeightTensor(
            info.name, qtype, shape, _view(cur.buf, start, qtype, shape), cur.path
        )
    _check_no_overlap(cur, spans)
    return tensors


def _check_tensor(cur: _Cursor, info: _TensorInfo, alignment: int) -> tuple[QType, tuple[int, ...], int]:
    """(type, numpy shape, byte size) of a tensor whose declared type, dims and offset are sane."""
    name = info.name
    try:
        qtype = QType(info.type_id)
    except ValueError:
        raise cur.error(f"tensor {name!r} has unknown ggml type id {info.type_id}") from None
    if qtype not in SUPPORTED_TYPES:
        raise cur.error(f"tensor {name!r} has unsupported type {qtype.name}")
    if 0 in info.ne:
        raise cur.error(f"tensor {name!r} has a zero dimension: ne={list(info.ne)}")
    n_elements = math.prod(info.ne)  # exact: Python ints
    if n_elements > INT64_MAX:
        raise cur.error(f"tensor {name!r} element count of ne={list(info.ne)} overflows int64")
    if info.offset % alignment:
        raise cur.error(f"tensor {name!r} data offset {info.offset} is misaligned (alignment {alignment})")
    try:
        rb = row_bytes(qtype, info.ne[0])
    except ValueError as e:
        raise cur.error(f"tensor {name!r}: {e}") from None
    return qtype, tuple(reversed(info.ne)), n_elements // info.ne[0] * rb


def _view(buf: mmap.mmap | memoryview, start: int, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """The stored tensor as a read-only view of the mmap: plain dtype of ``shape``, or uint8 block rows."""
    if qtype in PLAIN_TYPES:
        dtype, view_shape = np.dtype(PLAIN_TYPES[qtype]).newbyteorder("<"), shape
    else:
        dtype, view_shape = np.dtype(np.uint8), (*shape[:-1], row_bytes(qtype, shape[-1]))
    count = int(np.prod(view_shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(view_shape)


def _check_no_overlap(cur: _Cursor, spans: list[tuple[int, int, str]]) -> None:
    spans = sorted(spans)
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise cur.error(f"tensors {name!r} and {next_name!r} overlap in the file")
