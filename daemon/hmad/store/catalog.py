"""The models on disk: the store's pulled models and the embedded default one, read from GGUF headers
only (no weights are loaded); removing one."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import gguf

from hmad.core.errors import HmadError
from hmad.model import default
from hmad.model.gguf import read_gguf
from hmad.store.errors import StoreError
from hmad.store.manifest import Manifest, read_manifest
from hmad.store.paths import MANIFEST, store_dir
from hmad.store.refs import ModelRef, parse_ref


@dataclass
class ModelEntry:
    """One model on disk, as ``hmad models`` shows it."""

    name: str  # owner/repo:QUANT, or "default" (the embedded model)
    path: str  # the model's GGUF
    mmproj: str | None  # its projector GGUF (vision), if any
    architecture: str | None
    quantization: str | None
    size_bytes: int  # model and projector
    context_length: int | None
    chat_template: bool
    vision: bool
    loaded: bool = False
    problem: str | None = None  # why its header could not be read


@dataclass
class RemovedModel:
    name: str
    path: str
    freed_bytes: int


def human_size(n: int) -> str:
    """``n`` bytes for people: GB from 0.1 GB up, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def pulled(root: Path | None = None) -> list[tuple[Path, Manifest]]:
    """Every complete model folder of the store with its manifest, by name."""
    root = root or store_dir()
    found = [(p.parent, read_manifest(p.parent)) for p in root.glob(f"*/*/*/{MANIFEST}")]
    return sorted(((d, m) for d, m in found if m is not None), key=lambda x: x[1].name.lower())


def find_local(ref: ModelRef, root: Path | None = None) -> tuple[Path, Manifest] | None:
    """The pulled model ``ref`` names: its quant (case-insensitive); with no quant, the repository's one
    pulled model, else the one pulled as its default. None when there is none; StoreError when several
    fit and none was the default."""
    mine = [(d, m) for d, m in pulled(root) if m.repo.lower() == ref.repo.lower()]
    if ref.quant:
        return next(((d, m) for d, m in mine if m.quant.lower() == ref.quant.lower()), None)
    if len(mine) <= 1:
        return mine[0] if mine else None
    default_pull = [(d, m) for d, m in mine if m.requested is None]
    if default_pull:
        return default_pull[0]
    raise StoreError(
        f"{ref.repo} has several quants on disk ({', '.join(m.quant for _, m in mine)}): name one"
    )


def list_models(
    root: Path | None = None, loaded: str | None = None, include_default: bool = True
) -> list[ModelEntry]:
    """The embedded default model (once assembled, or its package installed) and every pulled model, each
    read from its GGUF header; ``loaded``: the model spec a daemon has loaded, marked on its entry."""
    out = []
    if include_default:
        path = default.default_model_path()  # its parts manifest: the size is the model's
        if path.exists():
            out.append(_entry(default.DEFAULT_NAME, path, None))
            out[-1].size_bytes = default.SIZE
        elif find_spec(default.PACKAGE.replace("-", "_")) is not None:
            out.append(
                ModelEntry(
                    default.DEFAULT_NAME, str(path), None, None, None, default.SIZE, None, False, False
                )
            )
            out[-1].problem = "not verified yet: hmad install-default-model"
    for folder, m in pulled(root):
        out.append(_entry(m.name, folder / m.model, folder / m.mmproj if m.mmproj else None))
    for e in out:
        e.loaded = loaded is not None and _is(e, loaded, root)
    return out


def _entry(name: str, path: Path, mmproj: Path | None) -> ModelEntry:
    size = path.stat().st_size + (mmproj.stat().st_size if mmproj and mmproj.exists() else 0)
    e = ModelEntry(name, str(path), str(mmproj) if mmproj else None, None, None, size, None, False, False)
    e.vision = mmproj is not None
    try:
        meta = read_gguf(path).metadata
    except HmadError as err:
        e.problem = str(err)
        return e
    arch = meta.get("general.architecture")
    e.architecture = arch if isinstance(arch, str) else None
    ctx = meta.get(f"{arch}.context_length")
    e.context_length = int(ctx) if isinstance(ctx, int) else None
    e.chat_template = isinstance(meta.get("tokenizer.chat_template"), str)
    e.quantization = _file_type(meta.get("general.file_type"))
    return e


def _file_type(value) -> str | None:
    """llama.cpp's ``general.file_type`` by name (``MOSTLY_Q4_K_M`` -> ``Q4_K_M``)."""
    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def _is(entry: ModelEntry, spec: str, root: Path | None) -> bool:
    """Whether ``spec`` (a path, ``default``, or a reference) names ``entry``."""
    if spec == entry.name or spec == entry.path:
        return True
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve() == Path(entry.path).resolve()
    try:
        hit = find_local(parse_ref(spec), root)
    except StoreError:
        return False
    return hit is not None and hit[1].name == entry.name


def remove_model(name: str, loaded: str | None = None, root: Path | None = None) -> RemovedModel:
    """Delete a pulled model's folder (its files and manifest). Refused for the embedded default model and
    for ``loaded`` (the spec of the model a daemon has loaded), with a StoreError."""
    root = root or store_dir()
    if name == default.DEFAULT_NAME:
        raise StoreError("the embedded default model is part of the install; it cannot be removed")
    hit = find_local(parse_ref(name), root)
    if hit is None:
        raise StoreError(f"no model {name!r} in {root} (hmad models lists them)")
    folder, m = hit
    entry = ModelEntry(m.name, str(folder / m.model), None, None, None, 0, None, False, False)
    if loaded is not None and _is(entry, loaded, root):
        raise StoreError(f"{m.name} is the loaded model; load another one (or stop the daemon) first")
    freed = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    shutil.rmtree(folder)
    for parent in (folder.parent, folder.parent.parent):  # the repository's and owner's folders, if empty
        if parent != root and not any(parent.iterdir()):
            parent.rmdir()
    return RemovedModel(m.name, str(folder), freed)
