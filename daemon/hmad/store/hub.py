"""The pull: a repository's files listed, the quant's GGUF and its projector chosen and fetched into the
store, each checked against the repository's sha256.

Through huggingface_hub: its model-info request (the file list with sizes and LFS sha256), its metadata
request and its HTTP download (progress bar, retries of a dropped connection from where it stopped). Not
hf_hub_download: in huggingface_hub 2.x it writes to a temporary name of its own and deletes it when a
transfer fails or the process stops, so a pull stopped at 90 % would start that file again from zero.
Here each file goes to a partial file in the model's folder (paths.part_path) that the next pull resumes
with a Range request, and it takes its name only once its sha256 matches (the library checks sizes, not
content).
The hub is ``$HF_ENDPOINT`` (read at each call), the token huggingface_hub's own (``HF_TOKEN``, hf auth).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from hmad.model.default import sha256_file
from hmad.store.catalog import find_local, human_size
from hmad.store.errors import StoreError
from hmad.store.manifest import Manifest, write_manifest
from hmad.store.paths import free_bytes, model_dir, part_path, store_dir
from hmad.store.refs import ModelRef, parse_ref
from hmad.store.select import Choice, RemoteFile, choose

DEFAULT_ENDPOINT = "https://huggingface.co"

#: progress(message, done_bytes, total_bytes): what a pull is doing (the bytes while a file transfers)
Progress = Callable[[str, int | None, int | None], None]


@dataclass
class PullResult:
    name: str  # owner/repo:QUANT, the name hmad models lists and --model takes
    folder: Path
    model_path: Path
    mmproj_path: Path | None
    size_bytes: int
    already_present: bool


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def pull(spec: str, root: Path | None = None, progress: Progress | None = None) -> PullResult:
    """Fetch ``spec`` (``[hf:]REPO[:QUANT]``) into the store unless it is there; StoreError (a message for
    the user) for a bad reference, a repository without GGUF, a quant it lacks, too little disk space, a
    failed transfer or a checksum mismatch. Models already in the store are never touched; a failed pull
    leaves no file under a finished name. ``progress``: None shows huggingface_hub's bar on a terminal."""
    ref = parse_ref(spec)
    root = root or store_dir()
    if (hit := _present(ref, root)) is not None:
        return _result(hit[0], hit[1], already=True)
    commit, files = list_files(ref.repo)
    choice = choose(ref.repo, files, ref.quant)
    folder = model_dir(root, ref.repo, choice.quant)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot write the model store {root}: {e.strerror or e}") from None
    try:
        with _locked(folder):
            if (hit := _present(ref, root)) is not None:  # another pull finished it while this one waited
                return _result(hit[0], hit[1], already=True)
            m = _fetch_all(ref, commit, choice, folder, progress)
    except StoreError:
        _prune_empty(folder, root)  # a refused pull leaves no empty folders behind
        raise
    return _result(folder, m, already=False)


def _present(ref: ModelRef, root: Path) -> tuple[Path, Manifest] | None:
    """The store's copy of ``ref``; None also when several quants fit (the hub's default decides)."""
    try:
        return find_local(ref, root)
    except StoreError:
        return None


def _fetch_all(ref: ModelRef, commit: str | None, choice: Choice, folder: Path, progress) -> Manifest:
    """The chosen files into ``folder``, then its manifest (last: the model exists from then on)."""
    wanted = [f for f in (choice.model, choice.mmproj) if f is not None]
    check_space(folder, wanted)
    for f in wanted:
        fetch(ref.repo, commit, f, folder, progress)
    m = Manifest(
        repo=ref.repo,
        quant=choice.quant,
        model=choice.model.name,
        mmproj=choice.mmproj.name if choice.mmproj else None,
        requested=ref.quant,
        commit=commit,
        pulled_at=datetime.now(UTC).isoformat(timespec="seconds"),
        files=[{"path": f.path, "name": f.name, "size": f.size, "sha256": f.sha256} for f in wanted],
    )
    write_manifest(folder, m)
    return m


def _prune_empty(folder: Path, root: Path) -> None:
    """Remove ``folder`` and its parents up to ``root`` while they hold nothing but the pull's lock file."""
    for d in (folder, folder.parent, folder.parent.parent):
        if d == root or any(p.name != ".lock" for p in d.iterdir()):
            return
        (d / ".lock").unlink(missing_ok=True)
        d.rmdir()


def _result(folder: Path, m: Manifest, already: bool) -> PullResult:
    mmproj = folder / m.mmproj if m.mmproj else None
    return PullResult(m.name, folder, folder / m.model, mmproj, m.size_bytes, already)


def list_files(repo: str) -> tuple[str | None, list[RemoteFile]]:
    """The repository's commit and files (path, size, LFS sha256), in one model-info request."""
    try:
        info = HfApi(endpoint=endpoint()).model_info(repo, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - each named in _hub_error, the rest re-raised
        raise _hub_error(e, repo) from None
    files = [
        RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0), s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
    ]
    return info.sha, files


def check_space(folder: Path, files: list[RemoteFile]) -> None:
    """StoreError when the file system of ``folder`` has less free space than the bytes still to fetch."""
    need = 0
    for f in files:
        if (folder / f.name).exists():
            continue
        part = part_path(folder / f.name, f.sha256)
        need += f.size - (part.stat().st_size if part.exists() else 0)
    free = free_bytes(folder)
    if free < need:
        raise StoreError(
            f"not enough disk space in {folder}: the pull needs {human_size(need)}, "
            f"{human_size(free)} is free"
        )


def fetch(repo: str, commit: str | None, f: RemoteFile, folder: Path, progress: Progress | None) -> Path:
    """One file into ``folder``: resumed from its partial file, verified, then renamed to its name."""
    final = folder / f.name
    if final.exists() and final.stat().st_size == f.size:  # verified by an earlier, unfinished pull
        return final
    part = part_path(final, f.sha256)
    for stale in folder.glob(f"{final.name}.*.part"):  # another revision's partial file
        if stale != part:
            stale.unlink()
    if part.exists() and part.stat().st_size > f.size:
        part.unlink()
    try:
        _transfer(repo, commit, f, part, progress)
    except Exception as e:
        raise _transfer_error(e, repo, f, part) from None
    return _verify(f, part, final, progress)


def _transfer_error(e: Exception, repo: str, f: RemoteFile, part: Path) -> Exception:
    """What a failed transfer tells the user. A dropped connection or the hub's refusal keeps the partial
    file (the next pull resumes it); a write that failed, or a transfer that ended at another size, removes
    it (nothing worth resuming; on a full disk, the space is given back)."""
    if isinstance(e, HfHubHTTPError | OfflineModeIsEnabled):
        return _hub_error(e, repo, f.path)
    if is_network_error(e):
        done = part.stat().st_size if part.exists() else 0
        return StoreError(
            f"the download of {f.name} from {endpoint()} failed after {human_size(done)} of "
            f"{human_size(f.size)} ({e}); pull again to resume it"
        )
    if not isinstance(e, OSError):
        return e
    part.unlink(missing_ok=True)
    if e.errno == errno.ENOSPC:
        return StoreError(
            f"the disk filled while writing {f.name} to {part.parent}; the partial file was removed and the "
            "models already there are untouched: free some space and pull again"
        )
    if e.errno is None:  # huggingface_hub's size check: the bytes received are not the file's size
        return StoreError(f"the download of {f.name} went wrong ({e}); the partial file was removed")
    return StoreError(f"cannot write {f.name} to {part.parent}: {e.strerror or e}")


def _transfer(repo: str, commit: str | None, f: RemoteFile, part: Path, progress: Progress | None) -> None:
    url = hf_hub_url(repo, f.path, revision=commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url, endpoint=endpoint())
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:  # a CDN: the hub's token stays home
        headers.pop("authorization", None)
    with open(part, "ab") as out:
        done = out.tell()
        if progress is not None:
            progress(f"pulling {f.name}", done, f.size)
        http_get(
            meta.location,
            out,
            resume_size=done,
            headers=headers,
            expected_size=f.size,
            displayed_filename=f.name,
            tqdm_class=_reporting_bar(progress, f.name) if progress else None,
        )


def _verify(f: RemoteFile, part: Path, final: Path, progress: Progress | None) -> Path:
    """``part`` renamed to ``final`` if its sha256 is the repository's; else removed, and a StoreError."""
    if progress is not None:
        progress(f"verifying {f.name}", None, None)
    if f.sha256 is not None:
        digest = sha256_file(part)
        if digest != f.sha256:
            part.unlink()
            raise StoreError(
                f"{f.name}: its sha256 is {digest}, the repository says {f.sha256}; the file was removed, "
                "pull again (a mismatch again means the mirror or the network alters it)"
            )
    os.replace(part, final)
    return final


def _reporting_bar(progress: Progress, name: str) -> type:
    """A huggingface_hub progress bar that also reports to ``progress``, once per percent transferred (a
    daemon logs each report)."""

    class Reporting(hf_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.done, self.size, self.said = kwargs.get("initial") or 0, kwargs.get("total"), -1

        def update(self, n=1):
            self.done += n
            percent = self.done * 100 // self.size if self.size else self.done
            if percent != self.said:
                self.said = percent
                progress(f"pulling {name}", self.done, self.size)
            return super().update(n)

    return Reporting


def _hub_error(e: Exception, repo: str, path: str | None = None) -> Exception:
    """The hub's answer as a StoreError (or ``e`` itself, when it is none of those)."""
    where = endpoint()
    if isinstance(e, GatedRepoError):
        return StoreError(f"{repo} is gated: accept its terms on {where}/{repo}, then log in (hf auth login)")
    if isinstance(e, RepositoryNotFoundError):
        return StoreError(f"no repository {repo} on {where} (or it is private: log in with hf auth login)")
    if isinstance(e, RemoteEntryNotFoundError):
        return StoreError(f"{repo} lists {path} but {where} does not serve it (404); try again later")
    if isinstance(e, OfflineModeIsEnabled):
        return StoreError(f"{repo} is not in the store and HF_HUB_OFFLINE forbids downloading it")
    if isinstance(e, HfHubHTTPError):
        return StoreError(f"{where} refused {path or repo}: {e}")
    if is_network_error(e):
        return StoreError(f"cannot reach {where} ({e}); models already pulled still load offline")
    return e


def is_network_error(e: Exception) -> bool:
    """A connection that failed or dropped, as huggingface_hub's HTTP client raises it (httpx's errors; by
    module, so that no one release of the client is imported here)."""
    client = type(e).__module__.split(".")[0]
    return isinstance(e, ConnectionError | TimeoutError) or client.startswith("httpx")


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One pull of a model folder at a time (another waits, then finds it done)."""
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
