"""The model requests of protocol version 5, answered on the socket loop: ``models``, ``load``,
``unload``, ``remove``, ``pull`` (docs/protocol.md, "Models"; docs/models.md).

What touches the disk (reading GGUF headers, deleting a folder, a pull) runs on a thread of its own; its
answer is queued and sent by the loop's next turn (``flush``), so the loop never waits on a disk or a
network. ``load`` and ``unload`` hand over to hmad/switching.py and answer at once with the switch's id;
``status``'s ``switch`` map then shows its phases. A pull runs in the background: ``status``'s ``pulls``
map shows its bytes, and a second pull of the same model joins the one running.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import asdict

from hmaclient import protocol as P
from hmad.store.catalog import list_models, remove_model
from hmad.store.errors import StoreError
from hmad.store.refs import parse_ref
from hmad.switching import Target, is_pullable, resolve_local

log = logging.getLogger("hmad.models")

KEEP_PULLS = 16  # finished pulls status still shows


class Pulls:
    """The daemon's pulls: one thread each, their progress by id (status ``pulls``)."""

    def __init__(self):
        self.entries: dict[str, dict] = {}  # id (str: map keys are str) -> progress
        self._running: dict[tuple[str, str], str] = {}  # (repo, quant) lower-cased -> id
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, spec: str) -> dict:
        """A pull of ``spec`` (StoreError for what is not a reference), or the one of it running already."""
        ref = parse_ref(spec)
        key = (ref.repo.lower(), (ref.quant or "").lower())
        with self._lock:
            if key in self._running:
                return {"pull_id": self._running[key], "joined": True, **self.entries[self._running[key]]}
            pid = str(next(self._ids))
            self.entries[pid] = {"model": spec, "state": "pulling", "phase": "starting"}
            self._running[key] = pid
            for old in [k for k, e in self.entries.items() if e["state"] != "pulling"][:-KEEP_PULLS]:
                del self.entries[old]
        threading.Thread(target=self._pull, args=(spec, pid, key), name="hmad-pull", daemon=True).start()
        return {"pull_id": pid, "joined": False, **self.entries[pid]}

    def _pull(self, spec: str, pid: str, key: tuple[str, str]) -> None:
        from hmad.store.hub import pull  # huggingface_hub: imported only when a pull is asked for

        entry = self.entries[pid]

        def progress(msg: str, done: int | None = None, total: int | None = None) -> None:
            entry["phase"] = msg
            if total:
                entry["done_bytes"], entry["total_bytes"] = done, total

        try:
            res = pull(spec, progress=progress)
            entry.update(name=res.name, size_bytes=res.size_bytes, already_present=res.already_present)
            entry.update(state="done", phase="already in the store" if res.already_present else "pulled")
        except Exception as e:  # noqa: BLE001 - StoreError's message is the user's; others named
            entry.update(
                state="failed", error=str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
            )
            log.warning("pull of %s failed: %s", spec, entry["error"])
        finally:
            with self._lock:
                self._running.pop(key, None)


class ModelRoutes:
    """The model requests of one server, the switcher deciding about loads."""

    def __init__(self, server, switcher):
        self.server, self.switcher = server, switcher
        self.pulls = Pulls()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (peer, reply) from the disk threads

    def handle(self, peer: bytes, req: P.ModelRequest) -> None:
        handler = getattr(self, "_" + req.kind)
        handler(peer, req)

    def flush(self) -> None:
        """Send the answers the disk threads have queued (called every loop turn)."""
        while True:
            try:
                peer, reply = self._answers.get_nowait()
            except queue.Empty:
                return
            self.server.replies.send(peer, reply)

    def status(self) -> dict:
        return {"pulls": {k: dict(e) for k, e in self.pulls.entries.items()}} if self.pulls.entries else {}

    # -- the requests ----------------------------------------------------------------------------------
    def _answer(self, peer: bytes, req, values: dict) -> None:
        self.server.replies.send(peer, P.result(req.id, values, v=req.v))

    def _refuse(self, peer: bytes, req, code: str, message: str) -> None:
        self.server.replies.send(peer, P.error(req.id, code, message, v=req.v))

    def _off_loop(self, peer: bytes, req, work) -> None:
        """``work()`` -> the result's values, on a thread; a StoreError -> (code, message) from ``_code``."""

        def run() -> None:
            try:
                reply = P.result(req.id, work(), v=req.v)
            except StoreError as e:
                reply = P.error(req.id, *self._code(e), v=req.v)
            except Exception as e:  # noqa: BLE001 - this request's error, never the thread's silent end
                log.exception("%s failed", req.kind)
                reply = P.error(req.id, P.INTERNAL, f"{type(e).__name__}: {e}", v=req.v)
            self._answers.put((peer, reply))

        threading.Thread(target=run, name=f"hmad-{req.kind}", daemon=True).start()

    @staticmethod
    def _code(e: StoreError) -> tuple[str, str]:
        text = str(e)
        if text.startswith("no model"):
            return P.MODEL_NOT_FOUND, text
        return (P.MODEL_IN_USE if "is the loaded model" in text else P.BAD_REQUEST), text

    def _models(self, peer: bytes, req) -> None:
        sw = self.switcher
        loaded = None if sw.state in ("idle", "failed") else sw.current.spec

        def work() -> dict:
            entries = [asdict(e) for e in list_models(loaded=str(sw.path) if loaded else None)]
            return {"models": entries, "loaded": loaded, "state": sw.state}

        self._off_loop(peer, req, work)

    def _remove(self, peer: bytes, req) -> None:
        sw = self.switcher
        loaded = None if sw.state in ("idle", "failed") else str(sw.path)  # idle: unloaded, may go
        target = sw.target.spec if sw.target is not None and sw.state in ("draining", "loading") else None
        if target is not None and resolve_local(target) == resolve_local(req.model):
            return self._refuse(
                peer, req, P.MODEL_IN_USE, f"{req.model} is loading; remove it once it is not"
            )
        self._off_loop(peer, req, lambda: asdict(remove_model(req.model, loaded=loaded)))

    def _pull(self, peer: bytes, req) -> None:
        try:
            values = self.pulls.start(req.model)
        except StoreError as e:
            return self._refuse(peer, req, P.BAD_REQUEST, str(e))
        self._answer(peer, req, values)

    def _load(self, peer: bytes, req) -> None:
        sw, spec = self.switcher, req.model
        path = resolve_local(spec)
        if path is None and not is_pullable(spec):
            msg = f"no model {spec!r} on this machine: a pulled model's name, hf:REPO[:QUANT] or a file"
            return self._refuse(peer, req, P.MODEL_NOT_FOUND, msg)
        if self.server.draining:
            return self._refuse(peer, req, P.SHUTTING_DOWN, "hmad is shutting down")
        if path is not None and path == sw.path and sw.state == "ready":
            return self._answer(peer, req, {"switch_id": sw.switch_id, "state": "ready", "unchanged": True})
        sw.forget_failure(path)
        sid = sw.begin(Target(spec), "hmactl load")
        self._answer(peer, req, {"switch_id": sid, "state": sw.state, "unchanged": False})

    def _unload(self, peer: bytes, req) -> None:
        sw = self.switcher
        if self.server.draining:
            return self._refuse(peer, req, P.SHUTTING_DOWN, "hmad is shutting down")
        if sw.state in ("idle", "failed"):
            return self._answer(peer, req, {"switch_id": sw.switch_id, "state": sw.state, "unchanged": True})
        sid = sw.begin(None, "hmactl unload")
        self._answer(peer, req, {"switch_id": sid, "state": sw.state, "unchanged": False})
