"""What ``status`` and ``metrics`` answer, from the socket loop's side.

Both read, never change, the ``Server`` (hmad/server.py) they are given: the engine's last snapshot (the
engine thread replaces it after each step), the model and its backend, and the loop's own counts (requests
in flight, connections, reply bytes queued). While the model loads (no engine attached yet) ``status``
shows the load's progress instead.
"""

from __future__ import annotations

import time


def connection_status(server) -> dict:
    """Connections served and refused, replies queued for peers (status and metrics)."""
    return {
        "connections": len(server.peers),
        "max_connections": server.peers.max_connections,
        "connections_refused": server.peers.refused,
        "queued_reply_bytes": server.replies.outboxes.total,
    }


def status(server) -> dict:
    """The ``status`` reply's fields."""
    if server.engine is None:
        return {
            "state": "loading",
            **server.loading_status(),
            "uptime_s": round(time.time() - server.started, 1),
            "draining": server.draining,
            **connection_status(server),
        }
    snap, model = dict(server.engine.snapshot), server.model
    return {
        "state": "ready",
        "model": model.path,
        "model_name": model.config.name,
        # whether chats get a template the model file (or the config's chat_template path) gives; false: a
        # base model, whose chats fall back to the built-in Gemma turns (clients prompt it raw by default)
        "chat_template": model.tokenizer.chat_template is not None,
        "backend": model.backend.name,
        "device": model.backend.device,
        "deterministic": bool(getattr(model.backend, "deterministic", False)),
        "memory": model.backend.describe().get("memory", {}),
        "context_length": server.engine.scheduler.context,
        "running": snap.get("running", 0),
        "queued": snap.get("queued", 0),
        "in_flight": len(server.routes),
        "recent_batch_sizes": snap.get("recent_batch_sizes", []),
        "step_ms": snap.get("step_ms", 0.0),
        "forward_ms": snap.get("forward_ms", 0.0),  # of step_ms: the forward pass; the rest is host work
        "json_mask_ms": snap.get("json_mask_ms", 0.0),
        "steps": snap.get("steps", 0),
        "pipelined_steps": snap.get("pipelined_steps", 0),  # of steps: engine.pipeline's
        "draws_corrected": snap.get("draws_corrected", 0),  # device draws the host's replaced
        "speculation": snap.get("speculation", {}),  # drafts checked and kept (docs/speculation.md)
        "server_us_per_reply": server.replies.us_per_reply(),
        "tokens_per_s": snap.get("tokens_per_s", 0.0),
        "tokens_generated": snap.get("tokens_generated", 0),
        "kv": snap.get("kv", {}),
        **vision_status(model, snap),
        "uptime_s": round(time.time() - server.started, 1),
        "draining": server.draining,
        **connection_status(server),
        **server.status_extra(),
    }


def vision_status(model, snap: dict) -> dict:
    """``vision`` (a model with a vision tower): its shape, where it runs, and the images it encoded (the
    engine's count, the last encode's time and the feature cache's use)."""
    if getattr(model, "vision", None) is None:
        return {}
    cfg = model.vision.cfg
    return {
        "vision": {
            "image_size": cfg.image_size,
            "tokens_per_image": cfg.mm_tokens_per_image,
            "layers": cfg.n_layers,
            "encoder": type(model.vision.ops).__name__,
            "images": snap.get("images", {}),
        }
    }


def metric_families(server) -> list[dict]:
    """The ``metrics`` reply's families: the counters, and what the engine and the backend report once
    they are there (the engine is attached after the server is made)."""
    loop = {
        "in_flight": len(server.routes),
        "uptime_s": round(time.time() - server.started, 3),
        **connection_status(server),
    }
    snapshot, memory = {}, {}
    if server.engine is not None and server.model is not None:
        backend = server.model.backend
        loop["info"] = {
            "model": server.model.config.name or server.model.path,
            "backend": backend.name,
            "device": str(backend.device),
        }
        snapshot, memory = dict(server.engine.snapshot), backend.describe().get("memory", {})
    return server.metrics.families(snapshot, loop, memory)
