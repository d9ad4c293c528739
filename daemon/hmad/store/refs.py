"""``REPO[:QUANT]`` and ``hf:REPO[:QUANT]``: a Hugging Face repository and, optionally, its quant::

ggml-org/gemma-3-4b-it-GGUF            the repository's default quant (select.py)
ggml-org/gemma-3-4b-it-GGUF:Q8_0       a quant, matched case-insensitively against file names
hf:unsloth/gemma-3-27b-it-GGUF:UD-Q4_K_XL
hf.co/owner/repo:Q4_K_M                 (Ollama's spelling of the same)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hmad.store.errors import StoreError

HF_PREFIX = "hf:"
_PREFIXES = (HF_PREFIX, "hf.co/", "huggingface.co/", "https://huggingface.co/")
_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_REPO = re.compile(rf"{_PART}/{_PART}")
_QUANT = re.compile(_PART)


@dataclass(frozen=True)
class ModelRef:
    """A repository (``owner/name``) and the quant asked for (None: the default one)."""

    repo: str
    quant: str | None = None

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def strip_prefix(spec: str) -> str:
    for p in _PREFIXES:
        if spec.startswith(p):
            return spec[len(p) :]
    return spec


def parse_ref(spec: str) -> ModelRef:
    """``[hf:]owner/name[:QUANT]`` -> ModelRef; StoreError saying the form when ``spec`` is not one."""
    repo, colon, quant = strip_prefix(spec.strip()).partition(":")
    if not _REPO.fullmatch(repo) or repo.endswith(".gguf") or (colon and not _QUANT.fullmatch(quant)):
        raise StoreError(
            f"{spec!r} is not a model reference: give REPO[:QUANT], e.g. ggml-org/gemma-3-4b-it-GGUF:Q4_K_M"
        )
    return ModelRef(repo, quant or None)


def looks_like_ref(spec: str) -> bool:
    """True when ``spec`` has the form of a reference (it may also be a relative path: callers check the
    file system first)."""
    try:
        parse_ref(spec)
    except StoreError:
        return False
    return True
