"""The model's life once hmad serves: another model loaded (a switch), the model unloaded, reloaded on demand.

States (``status``: ``state`` and the ``switch`` map; ``ping``'s state in brackets)::

    ready     serving                                                                 [ready]
      │ hmactl load / a generate naming another model / hmactl unload / models.keep_alive_s idle
      ▼
    draining  running requests finish (models.switch: finish, up to switch_grace_s) or are cancelled
              (cancel); requests that arrive wait ("parked")                          [loading]
      │ none left: the engine is taken off the server
      ▼
    unloading the engine stops, the backend closes (weights, KV cache, recordings freed) [loading]
      ▼
    loading   the next model loads (phase, uploaded_bytes / total_bytes)              [loading]
      │ loaded: the engine starts, the parked requests are prepared and served  → ready
      │ failed: the previous model is loaded back (→ ready), and if that fails too   → failed
    idle      unloaded (keep_alive, hmactl unload): the next generate loads it back   [ready]
    failed    no model: the next ``hmactl load`` tries again; generates get no_model  [no_model]

Every request that waits gets exactly one terminal reply: served once a model is up, cancelled if its
client cancels meanwhile, or refused (``no_model``, ``switch_refused``, ``model_not_found``) with a message.
The loop thread drives all of it (``tick``); the unload and the load run on a thread of their own
(``hmad-switch``), so the loop answers (status shows the phase) while the device works.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from hmaclient import protocol as P
from hmad.composition import attach_draft, load_model, resolve_backend_name
from hmad.config import Config
from hmad.engine import structured
from hmad.engine.scheduler import Scheduler
from hmad.faults import install as install_fault
from hmad.model import chat_template, default
from hmad.store.catalog import find_local
from hmad.store.errors import StoreError
from hmad.store.refs import HF_PREFIX, parse_ref
from hmad.store.resolve import is_store_ref

log = logging.getLogger("hmad.switching")

PARK = "park"  # what ``admit`` answers for a generate that waits for the model
_FIND = "hmactl models lists them; hmactl pull fetches one"
STUCK_S = 5.0  # past the drain's deadline, how long the engine gets to answer the cancelled requests


def load_scheduler(
    cfg: Config, spec: str, mmproj, progress, fault=None, shown: dict | None = None
) -> Scheduler:
    """``spec`` resident on the config's backend, its KV pools allocated and every step bucket made ready
    (recorded on a GPU), the vocabulary indexed for structured output: what serving needs before its first
    request. ``progress(message, done_bytes=None, total_bytes=None)`` as composition's; ``shown``: the
    load's status map, which gets the backend chosen."""
    backend = resolve_backend_name(cfg.backend, cfg.backend_options("npu"))  # auto: vulkan, npu or cpu
    if shown is not None:
        shown["backend"] = backend
    model = load_model(
        spec,
        backend=backend,
        mmproj=mmproj,
        progress=progress,
        background=True,
        **cfg.backend_options(backend),
    )
    scheduler = None
    try:
        template = cfg.chat_template if spec == cfg.model else "auto"  # a template file was for that model
        model.tokenizer.chat_template = chat_template.choose(template, model.tokenizer)
        if fault is not None and not fault.stalls_load:
            install_fault(model.backend, fault)
        t0 = time.perf_counter()
        scheduler = Scheduler(model, cfg.scheduler_config())  # while the weights upload
        if cfg.speculation.mode == "draft":  # beside the target, on its own backend (docs/speculation.md)
            attach_draft(scheduler, cfg.speculation.draft_model, progress, **cfg.backend_options(backend))
        scheduler.images.cache.max_bytes = cfg.vision.image_cache_bytes
        scheduler.images.waiting_bytes = cfg.vision.max_waiting_image_bytes
        scheduler.prepare()
        phases = model.info["load_phases_s"]
        phases["kv_and_prepare_s"] = round(time.perf_counter() - t0, 3)
        if structured.available():  # seconds, holding the GIL: never while serving (the loop would wait)
            t0 = time.perf_counter()
            progress("indexing the vocabulary for structured output")
            structured.Vocabulary.of(model.tokenizer)
            phases["vocabulary_index_s"] = round(time.perf_counter() - t0, 3)
        model.backend.wait_resident()
    except BaseException:
        model.backend.close()  # a failed load leaves nothing on the device
        if scheduler is not None:
            scheduler.speculator.close()
        raise
    return scheduler


def resolve_local(spec: str) -> Path | None:
    """The model file ``spec`` names on this machine (``default``, a pulled model's name, ``hf:REPO`` once
    pulled, or a path), without pulling; None when there is none."""
    if spec == default.DEFAULT_NAME:
        return default.default_model_path().resolve()
    if is_store_ref(spec):
        try:
            hit = find_local(parse_ref(spec))
        except StoreError:
            return None
        return None if hit is None else (hit[0] / hit[1].model).resolve()
    path = Path(spec).expanduser()
    return path.resolve() if path.exists() else None


@dataclass
class Target:
    """A model to load: the spec as named, its projector (the config's, for the config's model)."""

    spec: str
    mmproj: str | None = None


class Switcher:
    """Drives the states above from the socket loop (``tick``); ``service`` starts engines for it."""

    def __init__(self, service, server, spec: str, path: str):
        self.service, self.server, self.cfg = service, server, service.cfg
        self.state = "ready"
        self.current = Target(spec, self.cfg.mmproj if spec == self.cfg.model else None)
        self.path = Path(path).resolve()  # the file of the current (or last) model
        self.target: Target | None = None  # the next model (None: unload) once drained
        self.then: Target | None = None  # a load asked for while another loads: it comes next
        self.parked: dict[int, P.GenerateRequest] = {}  # rid -> a generate waiting for the model
        self.failed: dict[Path, str] = {}  # model files whose load failed -> why (until loaded again)
        self.load: dict = {}  # the load's phase, uploaded_bytes / total_bytes
        self.switch_id, self.error, self.released = 0, None, None
        self.deadline, self.cancelled, self.fallback = 0.0, False, False
        self.busy_at = time.monotonic()  # when a request last ran or waited (models.keep_alive_s)
        self._thread: threading.Thread | None = None
        self._result = None  # the load thread's Scheduler, or its exception
        self.more = lambda: {}  # more for status: the pulls (hmad/model_routes.py)
        self.facts: dict = {}  # the unloaded model's facts clients read (idle: it is the one loaded next)

    # -- asked by the server and the model routes ------------------------------------------------------
    def admit(self, req: P.GenerateRequest):
        """A new (or parked) generate: None (serve it now), PARK (it waits for the model) or (code,
        message) (refused)."""
        if req.model is not None:
            path = resolve_local(req.model)
            if path is None:
                return P.MODEL_NOT_FOUND, f"no model {req.model!r} on this machine ({_FIND})"
            if path in self.failed:
                return P.MODEL_NOT_FOUND, f"model {req.model!r} could not be loaded: {self.failed[path]}"
            other = path != self.path or self.state == "failed"
            if other and not self.cfg.models.allow_switch and self.state != "failed":
                return P.SWITCH_REFUSED, (
                    f"model {self.current.spec!r} is loaded and this daemon does not switch models per "
                    f"request (models.allow_switch: false); ask without a model or hmactl load {req.model}"
                )
            if other and self.cfg.models.allow_switch:
                if self.state in ("ready", "idle", "failed"):
                    self.begin(Target(req.model), "a request names it")
                return PARK
        if self.state == "failed":
            return P.NO_MODEL, f"no model is loaded ({self.error}); load one: hmactl load MODEL"
        if self.state == "idle":
            self.begin(self.current, "a request came")
        return None if self.state == "ready" else PARK

    def park(self, rid: int, req: P.GenerateRequest) -> None:
        self.parked[rid] = req
        self.busy_at = time.monotonic()

    def begin(self, target: Target | None, why: str) -> int:
        """Load ``target`` (None: unload) after the drain; the switch's id (status ``switch.id``)."""
        if target is not None and target.spec == self.cfg.model and target.mmproj is None:
            target = Target(target.spec, self.cfg.mmproj)
        if self.state in ("unloading", "loading"):
            self.then = target
            return self.switch_id + 1
        self.switch_id += 1
        self.target, self.error, self.fallback = target, None, False
        what = "unloading" if target is None else f"switching to {target.spec}"
        log.info("%s (%s; running requests: %s)", what, why, self.cfg.models.switch)
        if self.state in ("idle", "failed"):
            if target is not None:
                self._start([], target)
            return self.switch_id
        grace = self.cfg.models.switch_grace_s if self.cfg.models.switch == "finish" else 0.0
        self.state, self.cancelled = "draining", False
        self.deadline = time.monotonic() + grace
        self.load = {"phase": f"draining: {what}"}
        return self.switch_id

    def forget_failure(self, path: Path | None) -> None:
        """An explicit load of ``path``: try it again even if it failed before."""
        self.failed.pop(path, None)

    def ping_state(self) -> str:
        return {"ready": "ready", "idle": "ready", "failed": "no_model"}.get(self.state, "loading")

    def info(self) -> dict:
        """The ``switch`` map of status."""
        m = self.cfg.models
        info = {
            "state": self.state,
            "id": self.switch_id,
            "model": self.current.spec,
            "target": None if self.target is None else self.target.spec,
            "waiting": len(self.parked),
            "policy": m.switch,
            "keep_alive_s": m.keep_alive_s,
            "allow_switch": m.allow_switch,
        }
        if self.error is not None:
            info["error"] = self.error
        if self.released is not None:
            info["previous_released"] = self.released
        return info

    def loading_status(self) -> dict:
        """What status shows while no engine is attached (loading, idle, failed)."""
        model = self.target.spec if self.state == "loading" and self.target else self.current.spec
        facts = self.facts if self.state == "idle" else {}  # what hmactl fits its defaults to
        return {
            "state": self.state,
            "model": model,
            **facts,
            **self.load,
            "switch": self.info(),
            **self.more(),
        }

    def status_extra(self) -> dict:
        """Added to status while an engine serves (ready, draining)."""
        extra = {"switch": self.info(), **self.more()}
        if self.state == "draining":
            extra["state"], extra["phase"] = "draining", self.load.get("phase")
        return extra

    # -- the loop's turn -------------------------------------------------------------------------------
    def tick(self) -> None:
        self._answer_cancelled()
        if self.state == "ready":
            self._keep_alive()
        elif self.state == "draining":
            self._drain()
        elif self.state in ("unloading", "loading") and not self._thread.is_alive():
            self._loaded()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the switch thread (hmad stops: a load gives up at its next progress
        report); whether it has ended."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def stop(self) -> None:
        """hmad stops: the waiting requests are answered shutting_down (a load gives up by itself)."""
        self._refuse_parked(P.SHUTTING_DOWN, "hmad is shutting down")

    def _answer_cancelled(self) -> None:
        routes = self.server.routes
        for rid in list(self.parked):
            route = routes.get(rid)
            if route is None:  # its peer went away
                del self.parked[rid]
            elif route.cancel_asked:
                del self.parked[rid]
                self.server.metrics.request_ended("cancelled", "cancel")
                self.server.replies.end(rid, P.cancelled(route.client_id, 0, v=route.v))

    def _active(self) -> list[int]:
        return [rid for rid in self.server.routes if rid not in self.parked]

    def _keep_alive(self) -> None:
        keep, now = self.cfg.models.keep_alive_s, time.monotonic()
        snap = self.server.engine.snapshot
        if self.server.routes or snap.get("running", 0) or snap.get("queued", 0):
            self.busy_at = now
        elif keep is not None and now - self.busy_at >= keep:
            self.begin(None, f"idle for {keep:g} s (models.keep_alive_s)")

    def _drain(self) -> None:
        active, now = self._active(), time.monotonic()
        if active and now >= self.deadline and not self.cancelled:
            for rid in active:
                route = self.server.routes[rid]
                if route.preparing:
                    route.cancel_asked = True
                else:
                    self.server.engine.cancel(rid)
            self.cancelled = True  # once; the engine answers each at its next step
        if active and now < self.deadline + STUCK_S:
            return
        for rid in active:  # the engine did not answer in time: answer here
            route = self.server.routes[rid]
            self.server.metrics.request_ended("cancelled", "switch")
            self.server.replies.end(rid, P.cancelled(route.client_id, 0, v=route.v))
        self._start([self._detach()], self.target)

    def _detach(self):
        """The engine taken off the server (the loop serves no generate from here): it is stopped and its
        model freed on the switch thread (``_unload``), so the loop never waits on the device."""
        server = self.server
        engine, model = server.engine, server.model
        self.facts = {
            "model_name": model.config.name,
            "chat_template": model.tokenizer.chat_template is not None,
            "backend": model.backend.name,
            "device": model.backend.device,
        }
        del model
        server.replies.forward_events(engine.events)  # what it published last
        server.engine = server.model = None
        server.status_extra = lambda: {}
        self.service.loaded = None
        return engine

    def _start(self, box: list, target: Target | None) -> None:
        """The switch thread: the engine in ``box`` (if any) unloaded, then ``target`` (if any) loaded."""
        self.state = "unloading" if box else "loading"
        self.target, self._result = target, None
        self.load = {"phase": f"unloading {self.current.spec}" if box else f"loading {target.spec}"}
        self._thread = threading.Thread(
            target=self._work, args=(box, target), name="hmad-switch", daemon=True
        )
        self._thread.start()

    def _work(self, box: list, target: Target | None) -> None:
        try:
            if box:
                self._unload(box)
            if target is None:
                self._result = "unloaded"
                return
            self.state, self.load = "loading", {"phase": f"loading {target.spec}"}
            self._result = load_scheduler(
                self.cfg, target.spec, target.mmproj, self._progress, self.service.fault, self.load
            )
        except BaseException as e:  # noqa: BLE001 - the loop's tick decides what follows
            self._result = e

    def _unload(self, box: list) -> None:
        """Stop the engine and close the backend: the weights, the KV cache and the recordings are freed.
        ``released``: whether the model object is gone once collected (a weakref says)."""
        engine = box.pop()  # the only reference left: the server let go of it
        model = engine.scheduler.model
        engine.stop()
        gc.unfreeze()  # the loaded objects were frozen (service.freeze_loaded_objects)
        ref = weakref.ref(model)
        model.backend.close()
        engine.scheduler.speculator.close()  # a draft model's backend
        del engine, model
        gc.collect()
        self.released = ref() is None
        if not self.released:
            log.warning("the unloaded model is still referenced by %s", _referrers(ref()))
        log.info("unloaded %s", self.current.spec)

    def _progress(self, msg: str, done: int | None = None, total: int | None = None) -> None:
        self.service.progress_while_serving(msg)  # raises LoadCancelled once hmad stops
        self.load["phase"] = msg
        if total:
            self.load["uploaded_bytes"], self.load["total_bytes"] = done, total

    def _loaded(self) -> None:
        result, target = self._result, self.target
        self._thread = self._result = None
        if result == "unloaded":
            self.state, self.load = "idle", {"phase": "unloaded: the next request loads it again"}
            return self._release()
        if isinstance(result, Scheduler):
            self.service.start_engine(self.server, result)
            self.state, self.current = "ready", target
            self.path = Path(result.model.path).resolve()
            self.load, self.busy_at = {}, time.monotonic()
            self.failed.pop(self.path, None)
            log.info("serving %s", target.spec)
            self._release()
            return
        why = f"{type(result).__name__}: {result}"
        log.error("loading %s failed: %s", target.spec, why)
        path = resolve_local(target.spec)
        if path is not None and path != self.path:
            self.failed[path] = why
        failed = f"loading {target.spec} failed: {why}"
        self.error = f"{self.error}; then {failed}" if self.fallback and self.error else failed
        if not self.fallback and target != self.current and not self.service.stopping:
            self.fallback = True  # the previous model, back
            log.info("loading the previous model %s again", self.current.spec)
            return self._start([], self.current)
        self.state, self.load = "failed", {"phase": "no model loaded", "error": self.error}
        self._refuse_parked(P.NO_MODEL, f"no model is loaded ({self.error}); load one: hmactl load MODEL")

    def _release(self) -> None:
        """The parked requests, in order: prepared for the model now loaded, or waiting for the next one."""
        parked, self.parked = self.parked, {}
        for rid, req in parked.items():
            route = self.server.routes.get(rid)
            if route is None:
                continue
            why = self.admit(req)
            if why == PARK:
                self.parked[rid] = req
            elif why is None:
                self.server.prepare_request(rid, req)
            else:
                self._refuse(rid, *why)
        if self.then is not None and self.state in ("ready", "idle"):
            then, self.then = self.then, None
            self.begin(then, "asked while another loaded")

    def _refuse_parked(self, code: str, message: str) -> None:
        parked, self.parked = self.parked, {}
        for rid in parked:
            if rid in self.server.routes:
                self._refuse(rid, code, message)

    def _refuse(self, rid: int, code: str, message: str) -> None:
        route = self.server.routes[rid]
        self.server.metrics.request_refused(code)
        self.server.replies.end(rid, P.error(route.client_id, code, message, v=route.v))


def _referrers(obj) -> list[str]:
    return [type(r).__name__ for r in gc.get_referrers(obj)]


def is_pullable(spec: str) -> bool:
    """``hf:REPO[:QUANT]``: a load may pull it first (the store's rule)."""
    return spec.startswith(HF_PREFIX)
