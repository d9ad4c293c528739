"""Which files of a repository a pull takes: the GGUF of the quant asked for, and its projector.

The quant rule (after llama-server's ``-hf repo:quant``): a file whose name states that quant,
case-insensitively (``q8_0`` finds ``model-Q8_0.gguf``); else one whose name holds it between a separator
before and ``.`` or ``-`` after (``Q4_K`` never finds ``Q4_K_M``). Projectors (``mmproj*.gguf``) are
never the model.
With no quant: the first of :data:`DEFAULT_QUANTS` present, else the smallest Q4 or Q8 file, else the
repository's only GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from hmad.store.errors import StoreError

#: the default quants, in order of preference (Q4_0: the QAT repositories of Gemma 3 ship only that)
DEFAULT_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0")
#: projector precisions, in order of preference
PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")
_LABEL = re.compile(
    r"(?i)(?:^|[-._])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|T?Q\d_\d|BF16|F16|FP16|F32|MXFP4(?:_MOE)?))"
    r"(?:-\d{5}-of-\d{5})?\.gguf$"
)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class RemoteFile:
    """A file of the repository: its path there, size, and (LFS files) sha256."""

    path: str
    size: int
    sha256: str | None = None

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class Choice:
    quant: str
    model: RemoteFile
    mmproj: RemoteFile | None


def is_projector(f: RemoteFile) -> bool:
    return f.name.lower().endswith(".gguf") and "mmproj" in f.name.lower()


def model_files(files: list[RemoteFile]) -> list[RemoteFile]:
    return [f for f in files if f.name.lower().endswith(".gguf") and not is_projector(f)]


def quant_label(name: str) -> str:
    """The quant a file's name states (``gemma-3-4b-it-Q4_K_M.gguf`` -> ``Q4_K_M``), else its stem."""
    m = _LABEL.search(name)
    return m.group(1) if m else PurePosixPath(name).stem


def matches(name: str, quant: str) -> bool:
    return re.search(rf"(?i)(?:^|[^a-z0-9]){re.escape(quant)}[.-]", name) is not None


def available(files: list[RemoteFile]) -> list[str]:
    """The quants the repository has, each once, in name order."""
    return sorted({quant_label(f.name) for f in model_files(files)}, key=str.lower)


def choose(repo: str, files: list[RemoteFile], quant: str | None) -> Choice:
    """The model file for ``quant`` (None: the default) and the projector; StoreError when the repository
    has no GGUF, the quant is not there (the message lists those that are), or the file is split."""
    models = model_files(files)
    if not models:
        raise StoreError(f"{repo} has no GGUF file (hmad pulls GGUF repositories, e.g. a '-GGUF' one)")
    picked = _pick(models, quant) if quant else _default(models)
    if picked is None:
        have = ", ".join(available(files))
        if quant:
            raise StoreError(f"{repo} has no {quant} GGUF; it has: {have}")
        raise StoreError(f"{repo} has several GGUFs and none is a default quant: pick one of {have}")
    split = _SPLIT.search(picked.name)
    if split and int(split.group(2)) > 1:
        raise StoreError(
            f"{repo}: {picked.name} is split in {int(split.group(2))} files; hmad reads single-file GGUFs"
        )
    label = quant_label(picked.name) if _LABEL.search(picked.name) else (quant or quant_label(picked.name))
    return Choice(label, picked, _projector(files, picked))


def _pick(models: list[RemoteFile], quant: str) -> RemoteFile | None:
    found = [f for f in models if quant_label(f.name).lower() == quant.lower()] or [
        f for f in models if matches(f.name, quant)
    ]
    return min(found, key=lambda f: (len(f.path), f.path)) if found else None


def _default(models: list[RemoteFile]) -> RemoteFile | None:
    for q in DEFAULT_QUANTS:
        if f := _pick(models, q):
            return f
    q48 = [f for f in models if re.match(r"(?i)(UD-)?I?Q[48]", quant_label(f.name))]
    if q48:
        return min(q48, key=lambda f: f.size)
    return models[0] if len(models) == 1 else None


def _projector(files: list[RemoteFile], model: RemoteFile) -> RemoteFile | None:
    """The projector beside the model (same folder first), its precision by PROJECTOR_PREFERENCE."""
    folder = str(PurePosixPath(model.path).parent)
    found = [f for f in files if is_projector(f)]
    near = [f for f in found if str(PurePosixPath(f.path).parent) == folder] or found

    def rank(f: RemoteFile) -> tuple[int, int]:
        label, prefs = quant_label(f.name).lower(), PROJECTOR_PREFERENCE
        return (prefs.index(label) if label in prefs else len(prefs)), f.size

    return min(near, key=rank) if near else None
