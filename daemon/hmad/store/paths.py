"""Where models live on disk, and how one model's folder is laid out::

<store>/<owner>/<repo>/<QUANT>/manifest.json      written last: a folder without it is an unfinished pull
                              /<file>.gguf        each file renamed into place only once verified
                              /<file>.<sha>.part  a transfer in progress (resumed by the next pull)
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

SERVICE_DIR = Path("/var/lib/hmad/models")
SERVICE_USER = "hmad"
MANIFEST = "manifest.json"


def store_dir() -> Path:
    """``$HMAD_MODELS_DIR``; else, for the service, ``$STATE_DIRECTORY/models`` (systemd's StateDirectory=)
    or ``/var/lib/hmad/models`` (the process runs as user hmad); else ``$XDG_DATA_HOME/hmad/models``
    (``~/.local/share/hmad/models``)."""
    if os.environ.get("HMAD_MODELS_DIR"):
        return Path(os.environ["HMAD_MODELS_DIR"]).expanduser()
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state) / "models"
    if _user() == SERVICE_USER:
        return SERVICE_DIR
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "hmad" / "models"


def _user() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None


def model_dir(root: Path, repo: str, quant: str) -> Path:
    """The folder of ``repo`` (owner/name) at ``quant``."""
    owner, name = repo.split("/")
    return root / owner / name / quant


def part_path(final: Path, sha256: str | None) -> Path:
    """The partial file of ``final`` while it is transferred: named by the content it must end as, so a
    partial of another revision is never resumed into this one."""
    return final.with_name(f"{final.name}.{(sha256 or 'unknown')[:16]}.part")


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free
