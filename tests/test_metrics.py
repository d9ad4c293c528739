"""hmad.engine.metrics: histogram buckets, request outcomes and the families of the ``metrics`` reply,
without a daemon (test_hmactl.py and test_openai_gateway.py read them from a running one)."""

from __future__ import annotations

import pytest

from hmaclient import protocol as P
from hmaclient.prometheus import exposition
from hmad.engine.metrics import Histogram, Metrics, RateWindow


def test_histogram_buckets_are_cumulative_with_le_bounds():
    h = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.0, 1.5, 4.0, 9.0):
        h.observe(v)
    s = h.sample()
    assert s["buckets"] == [2, 3, 4]  # <= 1: 0.5 and 1.0 (the bound is inclusive); <= 2: + 1.5; <= 4: + 4.0
    assert s["count"] == 5 and s["sum"] == pytest.approx(16.0)


def test_rate_window_counts_the_last_span_only_and_stays_bounded():
    w = RateWindow(10.0)
    assert w.add(100.0, 5) == 0.0  # one sample: no rate yet
    assert w.add(102.0, 25) == pytest.approx(10.0)  # 20 tokens in 2 s
    assert w.add(110.0, 45) == pytest.approx(40 / 10)  # the sample at 100 s is exactly 10 s old: kept
    assert w.add(111.0, 55) == pytest.approx((55 - 25) / 9)  # ... and now dropped
    assert w.add(200.0, 55) == 0.0  # idle past the span: only this sample left
    assert len(w) == 1
    # one sample a step at 500 steps/s for 60 s: the window holds 10 s of them, not the minute
    for i in range(30_000):
        rate = w.add(300.0 + i / 500, 1000 + 3 * i)
    assert rate == pytest.approx(1500.0) and len(w) == 5001


def test_families_count_outcomes_and_read_the_snapshot():
    m = Metrics()
    m.request_ended("done", "stop", {"prompt_tokens": 7, "ttft_s": 0.02, "total_s": 0.3})
    m.request_ended("done", "stop", {"prompt_tokens": 3, "ttft_s": 0.2, "total_s": 1.3})
    m.request_ended("cancelled", "disconnect")
    m.request_refused(P.BUSY)
    m.step_done(3, 0.004)
    snapshot = {
        "tokens_generated": 40,
        "running": 1,
        "queued": 2,
        "kv": {"global_blocks_used": 5, "global_blocks": 9},
    }
    server = {"in_flight": 3, "uptime_s": 12.5, "info": {"model": "m", "backend": "cpu"}}
    fams = {f["name"]: f for f in m.families(snapshot, server, {"host RAM: KV cache": 1024})}
    requests = {
        (s["labels"]["outcome"], s["labels"]["reason"]): s["value"] for s in fams["requests"]["samples"]
    }
    assert requests == {("done", "stop"): 2, ("cancelled", "disconnect"): 1, ("error", "busy"): 1}
    assert fams["prompt_tokens"]["samples"][0]["value"] == 10
    ttft = fams["time_to_first_token_seconds"]["samples"][0]
    assert ttft["count"] == 2 and ttft["sum"] == pytest.approx(0.22)
    assert ttft["buckets"][ttft["bounds"].index(0.025)] == 1 and ttft["buckets"][-1] == 2
    assert fams["batch_size"]["samples"][0]["sum"] == 3
    gauges = {
        k: fams[k]["samples"][0]["value"] for k in ("generated_tokens", "running", "queued", "in_flight")
    }
    assert gauges == {"generated_tokens": 40, "running": 1, "queued": 2, "in_flight": 3}
    kv = {(s["labels"]["pool"], s["labels"]["state"]): s["value"] for s in fams["kv_blocks"]["samples"]}
    assert kv[("global", "used")] == 5 and kv[("global", "total")] == 9 and kv[("global", "cached")] == 0
    assert not any(name.startswith("prefix_cache") for name in fams)  # no prefix cache in the snapshot
    cache = {"lookups": 4, "hits": 3, "reused_tokens": 48, "evictions": 0}
    with_cache = m.families({**snapshot, "kv": {"prefix_cache": cache}}, server, {})
    assert {f["name"]: f["samples"][0]["value"] for f in with_cache if f["name"].startswith("prefix")} == {
        f"prefix_cache_{k}": v for k, v in cache.items()
    }
    assert fams["memory_bytes"]["samples"] == [{"labels": {"use": "host RAM: KV cache"}, "value": 1024}]
    # the wire form survives the protocol and renders as Prometheus text
    reply = P.parse_reply(P.pack(P.metrics(1, list(fams.values()))))
    assert len(reply.families) == len(fams)
    text = exposition(reply.families)
    assert 'hmad_requests_total{outcome="done",reason="stop"} 2.0' in text
    assert 'hmad_time_to_first_token_seconds_bucket{le="+Inf"} 2.0' in text
    assert 'hmad_info{backend="cpu",model="m"} 1.0' in text


def test_families_before_the_engine_is_attached():
    """Nothing from the engine or the backend yet (the model still loading): zeros, and still valid."""
    fams = {f["name"]: f for f in Metrics().families({}, {"in_flight": 0, "uptime_s": 0.5}, {})}
    assert fams["running"]["samples"][0]["value"] == 0 and fams["memory_bytes"]["samples"] == []
    assert {s["value"] for s in fams["kv_blocks"]["samples"]} == {0}
    assert "hmad_uptime_seconds 0.5" in exposition(list(fams.values()))
