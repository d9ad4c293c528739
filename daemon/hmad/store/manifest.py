"""A pulled model's manifest (``manifest.json`` in its folder): where it came from and what it holds.

    {"repo": "owner/name", "quant": "Q4_K_M", "requested": "q4_k_m" | null, "commit": "<sha>" | null,
     "model": "<file>.gguf", "mmproj": "<file>.gguf" | null, "pulled_at": "<ISO 8601 UTC>",
     "files": [{"path": "<path in the repository>", "name": "<file>", "size": 123, "sha256": "<hex>"}]}

Written last, atomically: a folder has a manifest only when every file in it is whole and verified.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hmad.store.paths import MANIFEST


@dataclass
class Manifest:
    repo: str
    quant: str
    model: str
    mmproj: str | None = None
    requested: str | None = None  # the quant asked for; None: pulled as the repository's default
    commit: str | None = None
    pulled_at: str = ""
    files: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.quant}"

    @property
    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of ``folder``; None when it has none (an unfinished pull) or it is unreadable."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        return Manifest(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(manifest), indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)
