"""The daemon's metrics: counters and histograms kept since start, and the ``metrics`` reply built from them.

The server counts how requests end (``request_ended``, ``request_refused``) and the engine thread times its
steps (``step_done``); ``families()`` adds the gauges read at the moment of asking (queue, KV blocks,
memory per heap) and returns the wire form that hmaclient.protocol describes. Plain numbers only: rendering
them as Prometheus text is the client's business (hmaclient.prometheus), so the daemon does not depend on
prometheus_client.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any

# Upper bounds of the histograms' buckets (an observation v counts in every bucket with v <= bound).
TTFT_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
REQUEST_BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RateWindow:
    """A running total's rate over the last ``span_s`` seconds, O(1) a sample: the engine takes one every
    step, so a per-step list rebuild would cost a small model's whole per-token host budget
    (docs/tuning.md)."""

    def __init__(self, span_s: float = 10.0):
        self.span_s = span_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, total: int) -> float:
        """Record ``total`` at time ``now`` (seconds, not decreasing); its rate since the oldest sample
        within the span (0.0 while there is only one)."""
        self._samples.append((now, total))
        while now - self._samples[0][0] > self.span_s:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def __len__(self) -> int:
        return len(self._samples)


class Histogram:
    """Counts of observations per bucket, their number and sum. Callers hold the Metrics lock."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: over every bound
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v

    def sample(self) -> dict[str, Any]:
        cumulative, n = [], 0
        for c in self.counts[:-1]:
            n += c
            cumulative.append(n)
        return {
            "labels": {},
            "bounds": list(self.bounds),
            "buckets": cumulative,
            "count": n + self.counts[-1],
            "sum": self.sum,
        }


class Metrics:
    """Everything counted since the daemon started; thread-safe (the server and the engine thread write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()  # (outcome, reason)
        self.prompt_tokens = 0
        self.ttft = Histogram(TTFT_BOUNDS_S)
        self.request_s = Histogram(REQUEST_BOUNDS_S)
        self.batch = Histogram(BATCH_BOUNDS)
        self.step_s = Histogram(STEP_BOUNDS_S)

    # -- writers ---------------------------------------------------------------------------------------
    def request_ended(self, outcome: str, reason: str, stats: dict[str, Any] | None = None) -> None:
        """An accepted generation ended: outcome done (reason: finish reason), error (its code) or
        cancelled (``cancel``: asked or drained; ``disconnect``: its client went away). ``stats`` are the
        engine's (prompt_tokens, ttft_s, total_s, ...) when it has them."""
        with self._lock:
            self.requests[outcome, reason] += 1
            if stats:
                self.prompt_tokens += stats.get("prompt_tokens", 0)
                if outcome == "done":
                    self.ttft.observe(stats.get("ttft_s", 0.0))
                    self.request_s.observe(stats.get("total_s", 0.0))

    def request_refused(self, code: str) -> None:
        """A request answered with ``error`` before it was accepted (its error code)."""
        with self._lock:
            self.requests["error", code] += 1

    def step_done(self, batch_size: int, seconds: float) -> None:
        """The engine ran one step over ``batch_size`` sequences in ``seconds``."""
        with self._lock:
            self.batch.observe(batch_size)
            self.step_s.observe(seconds)

    # -- the reply -------------------------------------------------------------------------------------
    def families(
        self, snapshot: dict[str, Any], server: dict[str, Any], memory: dict[str, int]
    ) -> list[dict]:
        """The ``metrics`` reply's families: the counters, then gauges from the engine's ``snapshot``, the
        ``server``'s (in_flight, uptime_s, connections, connections_refused, queued_reply_bytes, and info:
        a map of str such as model and backend) and the
        backend's ``memory`` (bytes per heap and use)."""
        with self._lock:
            requests = [
                {"labels": {"outcome": o, "reason": r}, "value": n}
                for (o, r), n in sorted(self.requests.items())
            ]
            fams = [
                _family("requests", "counter", "Generations by how they ended (or were refused)", requests),
                _counter("prompt_tokens", "Prompt tokens of the generations that ended", self.prompt_tokens),
                _histogram(
                    "time_to_first_token_seconds", "Arrival to first token, done generations", self.ttft
                ),
                _histogram("request_duration_seconds", "Arrival to end, done generations", self.request_s),
                _histogram("batch_size", "Sequences in one engine step", self.batch),
                _histogram("step_duration_seconds", "Wall time of one engine step", self.step_s),
            ]
        fams += [
            _counter("generated_tokens", "Tokens generated", snapshot.get("tokens_generated", 0)),
            _gauge(
                "tokens_per_second", "Generated tokens per second, last 10 s", snapshot.get("tokens_per_s", 0)
            ),
            _gauge("running", "Sequences being decoded or prefilled", snapshot.get("running", 0)),
            _gauge("queued", "Requests waiting for a sequence slot or KV blocks", snapshot.get("queued", 0)),
            _gauge("in_flight", "Generations accepted and not yet ended", server.get("in_flight", 0)),
            _gauge("uptime_seconds", "Seconds since the daemon started serving", server.get("uptime_s", 0)),
            _gauge("connections", "Client connections open", server.get("connections", 0)),
            _counter(
                "connections_refused",
                "Connections closed at once, over server.max_connections",
                server.get("connections_refused", 0),
            ),
            _gauge(
                "queued_reply_bytes",
                "Reply bytes queued for clients not reading yet (capped by server.max_reply_bytes)",
                server.get("queued_reply_bytes", 0),
            ),
            _family(
                "info", "gauge", "What is served (value 1)", [{"labels": server.get("info", {}), "value": 1}]
            ),
            _family("kv_blocks", "gauge", "KV cache blocks by pool and state", _kv_samples(snapshot)),
            *_prefix_cache(snapshot),
            *_speculation(snapshot),
            *_images(snapshot),
            _family(
                "memory_bytes",
                "gauge",
                "Bytes held, by heap and use (the backend's memory plan)",
                [{"labels": {"use": k}, "value": v} for k, v in memory.items() if isinstance(v, int | float)],
            ),
        ]
        return fams


def _kv_samples(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """used / total / cached blocks of each pool (global: full-attention layers, local: sliding window).

    ``cached`` (blocks kept for prefix reuse) is read where the KV manager reports ``<pool>_blocks_cached``,
    else 0."""
    kv = snapshot.get("kv", {})
    out = []
    for pool in ("global", "local"):
        for state, key in (
            ("used", f"{pool}_blocks_used"),
            ("total", f"{pool}_blocks"),
            ("cached", f"{pool}_blocks_cached"),
        ):
            out.append({"labels": {"pool": pool, "state": state}, "value": kv.get(key, 0)})
    return out


def _prefix_cache(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefix cache's counters, where the KV manager reports them (``kv.prefix_cache``)."""
    stats = snapshot.get("kv", {}).get("prefix_cache")
    if not isinstance(stats, dict):
        return []
    helps = {
        "lookups": "Prompts looked up in the prefix cache",
        "hits": "Prompts that reused cached blocks",
        "reused_tokens": "Prompt tokens taken from the prefix cache instead of computed",
        "evictions": "Cached blocks evicted for new ones",
    }
    return [_counter(f"prefix_cache_{k}", text, stats.get(k, 0)) for k, text in helps.items()]


def _speculation(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Speculative decoding's counts and gauges (engine/speculation: ``speculation`` of the snapshot)."""
    st = snapshot.get("speculation")
    if not isinstance(st, dict):
        return []
    return [
        _counter("speculation_drafted_tokens", "Draft tokens checked", st.get("drafted", 0)),
        _counter("speculation_accepted_tokens", "Draft tokens kept", st.get("accepted", 0)),
        _counter(
            "speculation_rolled_back_tokens", "KV positions of drafts not kept", st.get("rolled_back", 0)
        ),
        _gauge("speculation_acceptance_rate", "Kept / checked draft tokens", st.get("acceptance_rate", 0.0)),
        _gauge("speculation_mean_k", "Mean k of the running sequences that speculate", st.get("mean_k", 0.0)),
    ]


def _family(name: str, kind: str, help: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "type": kind, "help": help, "samples": samples}


def _images(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Images through the vision tower and the feature cache (engine/images.py), once the engine reports
    them (``images``)."""
    stats = snapshot.get("images")
    if not stats:
        return []
    return [
        _counter("images_encoded", "Images run through the vision tower", stats.get("encoded", 0)),
        _counter(
            "image_cache_hits", "Images whose soft tokens came from the feature cache", stats.get("hits", 0)
        ),
        _gauge("image_cache", "Encoded images kept in the feature cache", stats.get("images", 0)),
        _gauge("image_cache_bytes", "Bytes of soft tokens kept in the feature cache", stats.get("bytes", 0)),
    ]


def _counter(name: str, help: str, value: float) -> dict[str, Any]:
    return _family(name, "counter", help, [{"labels": {}, "value": value}])


def _gauge(name: str, help: str, value: float) -> dict[str, Any]:
    return _family(name, "gauge", help, [{"labels": {}, "value": value}])


def _histogram(name: str, help: str, h: Histogram) -> dict[str, Any]:
    return _family(name, "histogram", help, [h.sample()])
