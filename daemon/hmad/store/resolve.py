"""``--model`` names a store model: ``hf:REPO[:QUANT]`` (pulled on first use) or a pulled model's name."""

from __future__ import annotations

from pathlib import Path

from hmad.core.errors import ModelNotFoundError
from hmad.store.catalog import find_local
from hmad.store.paths import store_dir
from hmad.store.refs import HF_PREFIX, looks_like_ref, parse_ref


def is_store_ref(spec: str | Path) -> bool:
    """``hf:...``, or the form ``owner/repo[:QUANT]`` where no such file or folder exists."""
    s = str(spec)
    return s.startswith(HF_PREFIX) or (looks_like_ref(s) and not Path(s).expanduser().exists())


def resolve_model_ref(spec: str, progress=None, root: Path | None = None) -> tuple[Path, Path | None]:
    """The local paths (model GGUF, projector GGUF or None) of ``spec``: from the store when it is there
    (no network), else pulled first when ``spec`` is ``hf:...``; a plain name not in the store is a
    ModelNotFoundError saying how to pull it. ``progress``: as hub.pull's."""
    root = root or store_dir()
    hit = find_local(parse_ref(spec), root)
    if hit is None and not spec.startswith(HF_PREFIX):
        raise ModelNotFoundError(
            f"model {spec!r} is neither a file nor a model in {root}: pull it (hmad pull {spec}) or name it "
            f"hf:{spec} to pull it on first use"
        )
    if hit is not None:
        folder, m = hit
        return folder / m.model, (folder / m.mmproj if m.mmproj else None)
    from hmad.store.hub import pull  # huggingface_hub: imported only when a pull is due

    result = pull(spec, root, progress)
    return result.model_path, result.mmproj_path
