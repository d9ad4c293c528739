"""One file stored as consecutive parts, read as one: a parts manifest and the mapping of its parts.

The embedded model's PyPI packages ship one GGUF cut into parts (hmad.model.default). Rather than
assembling a second copy on disk, hmad writes a small *manifest* naming the parts, and the GGUF reader maps
the parts side by side into one read-only address range: the reader and every tensor view see one
contiguous buffer, exactly as with a single file's ``mmap``, and the bytes stay in the page cache of the
part files (shared between processes, never copied).

Manifest (UTF-8 text; a file whose first bytes are :data:`MAGIC` is a manifest, anything else is not)::

    HMAD-GGUF-PARTS 1
    sha256 <hex of the whole byte range> <total size>
    <size> <mtime_ns> <absolute path of part 0>
    ...                                       one line a part, in order; the path last (it may hold spaces)

The sha256 held when each part had that size and mtime: a part whose size or mtime differs is refused
(:func:`map_manifest`), so a manifest is also the verification stamp that spares hashing at every start.

Mapping without a copy needs every part but the last to be a whole number of allocation units
(``mmap.ALLOCATIONGRANULARITY``, the page size on Linux): a part is then mapped with ``MAP_FIXED`` at its
offset inside one reserved range. Parts cut elsewhere are read into one anonymous buffer instead (the whole
size, logged): correct, but held in RAM.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path

from hmad.core.errors import ModelFormatError, ModelNotFoundError

log = logging.getLogger("hmad.model")

MAGIC = b"HMAD-GGUF-PARTS 1\n"
_MAX_MANIFEST_BYTES = 1 << 20
_MAX_PARTS = 4096


@dataclass(frozen=True)
class Part:
    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class PartsManifest:
    """The parts of one byte range, in order, and the sha256 of their concatenation."""

    sha256: str
    parts: tuple[Part, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def stat_part(path: str | os.PathLike[str]) -> Part:
    """``path`` as a Part (its size and mtime now); ModelNotFoundError naming it when it is not a file."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise ModelNotFoundError(f"part {path} is missing ({e.strerror or e})") from e
    if not path.is_file():
        raise ModelNotFoundError(f"part {path} is not a regular file")
    return Part(path, st.st_size, st.st_mtime_ns)


def changed_parts(manifest: PartsManifest) -> list[str]:
    """Why each part no longer matches its line (missing, another size or mtime); empty when all do."""
    problems = []
    for p in manifest.parts:
        try:
            now = stat_part(p.path)
        except ModelNotFoundError as e:
            problems.append(str(e))
            continue
        if (now.size, now.mtime_ns) != (p.size, p.mtime_ns):
            problems.append(f"part {p.path} changed since it was verified (size {now.size}, was {p.size})")
    return problems


def is_manifest(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def write_manifest(path: Path, manifest: PartsManifest) -> None:
    """Write ``manifest`` at ``path`` atomically (a private name, then renamed): readers see it whole."""
    lines = [MAGIC.decode().rstrip("\n"), f"sha256 {manifest.sha256} {manifest.size}"]
    lines += [f"{p.size} {p.mtime_ns} {p.path.resolve()}" for p in manifest.parts]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(path: str | os.PathLike[str]) -> PartsManifest:
    """Parse a manifest; ModelFormatError naming it and the line when it is malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ModelFormatError(path, f"cannot open: {e.strerror or e}") from e
    if not raw.startswith(MAGIC):
        raise ModelFormatError(path, "not a parts manifest")
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise ModelFormatError(path, f"parts manifest over {_MAX_MANIFEST_BYTES} bytes")
    try:
        lines = raw.decode("utf-8").splitlines()[1:]
        return _parse(lines)
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise ModelFormatError(path, f"malformed parts manifest: {e}") from None


def _parse(lines: list[str]) -> PartsManifest:
    if not lines:
        raise ValueError("no 'sha256 HEX SIZE' line")
    word, digest, total = lines[0].split(" ")
    if word != "sha256" or len(digest) != 64:
        raise ValueError(f"line 2 is {lines[0]!r}, expected 'sha256 HEX SIZE'")
    int(digest, 16)
    parts = []
    for i, line in enumerate(lines[1:], 3):
        size, mtime_ns, path = line.split(" ", 2)
        if int(size) < 0 or not Path(path).is_absolute():
            raise ValueError(f"line {i} is {line!r}, expected 'SIZE MTIME_NS /ABSOLUTE/PATH'")
        parts.append(Part(Path(path), int(size), int(mtime_ns)))
    if not 0 < len(parts) <= _MAX_PARTS:
        raise ValueError(f"{len(parts)} parts (1 to {_MAX_PARTS} allowed)")
    manifest = PartsManifest(digest.lower(), tuple(parts))
    if manifest.size != int(total):
        raise ValueError(f"the parts hold {manifest.size} bytes, line 2 says {total}")
    return manifest


def map_manifest(path: str | os.PathLike[str]) -> memoryview:
    """The byte range ``path`` (a manifest) describes, read-only and contiguous (see the module docstring).

    ModelNotFoundError naming a missing part; ModelFormatError naming a part that changed since the
    manifest was written, or the manifest itself when it is malformed."""
    manifest = read_manifest(path)
    problems = changed_parts(manifest)
    if problems:
        raise ModelFormatError(path, "; ".join(problems) + " (hmad install-default-model verifies it again)")
    return map_parts(manifest.parts)


def map_parts(parts: tuple[Part, ...] | list[Part]) -> memoryview:
    """The concatenation of ``parts`` as one read-only buffer: mapped in place when the parts are cut at
    allocation units, else copied into memory."""
    sizes = [p.size for p in parts]
    if all(s % mmap.ALLOCATIONGRANULARITY == 0 for s in sizes[:-1]):
        return _map_side_by_side(parts)
    log.warning(
        "the parts of %s are not cut at page boundaries: %d bytes copied into memory",
        parts[0].path,
        sum(sizes),
    )
    return _read_into_memory(parts)


def _read_into_memory(parts) -> memoryview:
    out = bytearray(sum(p.size for p in parts))
    view, pos = memoryview(out), 0
    for p in parts:
        with _open_part(p) as f:
            if f.readinto(view[pos : pos + p.size]) != p.size:
                raise ModelFormatError(p.path, f"part shorter than its {p.size} bytes")
        pos += p.size
    return view.toreadonly()


def _open_part(p: Part):
    try:
        return open(p.path, "rb")
    except OSError as e:
        raise ModelNotFoundError(f"part {p.path} cannot be opened ({e.strerror or e})") from e


# --- parts side by side in one address range (POSIX mmap through ctypes: Python's mmap takes no address) ---

_MAP_FIXED = 0x10  # the same value on Linux, the BSDs and macOS
_PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    int_, size_t = ctypes.c_int, ctypes.c_size_t
    # mmap(addr, length, prot, flags, fd, offset)
    libc.mmap.argtypes = [ctypes.c_void_p, size_t, int_, int_, int_, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, size_t]
    return libc


def _map_side_by_side(parts) -> memoryview:
    """Reserve one range (no access, no memory), then map each part over its slice of it with MAP_FIXED.
    The range is unmapped when the last view of the returned buffer is gone."""
    libc, total = _libc(), sum(p.size for p in parts)
    length = max(-(-total // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY, 1)
    base = libc.mmap(None, length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        problem = os.strerror(ctypes.get_errno())
        raise MemoryError(f"cannot reserve {length} bytes of address space: {problem}")
    try:
        offset = 0
        for p in parts:
            if p.size:
                _map_part(libc, p, base + offset)
            offset += p.size
    except BaseException:
        libc.munmap(base, length)
        raise
    region = (ctypes.c_ubyte * total).from_address(base)
    weakref.finalize(region, libc.munmap, base, length).atexit = False  # at exit a thread may still read it
    return memoryview(region).cast("B").toreadonly()


def _map_part(libc, p: Part, addr: int) -> None:
    with _open_part(p) as f:
        size = os.fstat(f.fileno()).st_size
        if size != p.size:  # mapping past a file's end would fault on first touch, not fail here
            raise ModelFormatError(p.path, f"part holds {size} bytes, expected {p.size}")
        got = libc.mmap(addr, p.size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, f.fileno(), 0)
    if got != addr:
        raise ModelFormatError(p.path, f"cannot map the part: {os.strerror(ctypes.get_errno())}")
