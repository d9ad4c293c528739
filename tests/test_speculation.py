"""Speculative decoding, prompt lookup (docs/speculation.md): the same answers with and without it.

A real engine on a tiny GGUF (tests/tiny_gguf.py) with ``deterministic`` on: a sequence's logits do not
depend on how its positions are batched, so a greedy request's tokens, and a sampled one's for a given
seed, must be the same speculating or not (engine/speculation/speculator.py: each emitted token uses one
uniform, as without speculation). The prompts repeat a pattern that the tiny model does not continue, so
lookup proposes drafts, some kept and some rejected; every test checks both happened where it matters.
The sampled distribution is also checked against the model's own, computed exactly by teacher forcing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from daemon_harness import Daemon, run_in_threads
from tiny_gguf import make_tiny_gguf

from hmad.composition import load_model
from hmad.core.kv_layout import KVLayout
from hmad.engine.generate import forward_full
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Request
from hmad.engine.sampling import Sampler, SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig
from hmad.engine.speculation import SpeculationConfig
from hmad.engine.speculation.lookup import lookup
from hmad.engine.structured import compile_schema

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LOOKUP = SpeculationConfig(mode="lookup", max_batch=8)
# The sampled test's bound on total variation: an exact sampler's expected TV over its 8 cells at 1024
# draws is at most ~0.035 (the sum of 0.4 sqrt(p (1 - p) / n)); a sampler off by 0.2 fails.
TV_BOUND = 0.07


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", seed=7)
    return load_model(path, backend="cpu", deterministic=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """BOS, a 6-token pattern three times, 3 other tokens, then the pattern's first two again: lookup
    drafts the pattern's rest, which the tiny model does not always follow."""
    out = []
    for i in range(n):
        r = np.random.default_rng(seed + i)
        pat = r.integers(6, 300, 6).tolist()
        out.append([2, *pat * 3, *r.integers(6, 300, 3).tolist(), *pat[:2]])
    return out


def run(model, reqs: list[Request], spec: SpeculationConfig | None = None, max_seqs: int = 8, on_step=None):
    """Drive a scheduler until every request ends: ({request id: its events}, scheduler)."""
    cfg = SchedulerConfig(max_seqs=max_seqs, kv_tokens=4096, block_size=4, speculation=spec or LOOKUP)
    sched = Scheduler(model, cfg)
    return run_all(sched, reqs, on_step), sched


def run_all(sched: Scheduler, reqs: list[Request], on_step=None) -> dict:
    """``reqs`` through a scheduler that may have run others: {request id: its events}; ``on_step(sched)``
    after every step."""
    events = {r.id: [] for r in reqs}
    for r in reqs:
        sched.submit(r)
    while sched.has_work():
        for ev in sched.step():
            events[ev.request_id].append(ev)
        if on_step:
            on_step(sched)
    return events


def requests(ps: list[list[int]], params: SamplingParams, grammar=None, speculate=True) -> list[Request]:
    return [
        Request(i, p, dataclasses.replace(params), grammar=grammar, speculate=speculate)
        for i, p in enumerate(ps)
    ]


def answers(events: dict) -> dict:
    """Per request: (token ids, text, its terminal kind and finish reason), each ending exactly once."""
    out = {}
    for rid, evs in events.items():
        ends = [e for e in evs if e.terminal]
        assert len(ends) == 1 and evs[-1].terminal, f"request {rid}: {[e.kind for e in evs]}"
        ids = [t for e in evs for t in e.token_ids]
        out[rid] = (ids, "".join(e.text for e in evs), ends[0].kind, ends[0].finish_reason)
    return out


def assert_no_blocks_held(sched: Scheduler) -> None:
    """Every block given back: none used (cached ones are evictable), no sequence left."""
    u = sched.kv.usage()
    assert u["global_blocks_used"] == 0 and u["local_blocks_used"] == 0 and u["sequences"] == 0, u
    assert sched.kv.global_pool.promised == 0 and sched.kv.local_pool.promised == 0


def both(model, make, spec: SpeculationConfig = LOOKUP, **kw):
    """The answers of the same requests without and with speculation, and the speculating run's stats."""
    off, _ = run(model, make(), SpeculationConfig(), **kw)
    on, sched = run(model, make(), spec, **kw)
    assert_no_blocks_held(sched)
    return answers(off), answers(on), sched.status()["speculation"]


# -- the drafter and the rollback, alone ----------------------------------------------------------------
def test_lookup_takes_the_longest_suffix_and_its_first_match():
    assert lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 4, 1, 3) == [9, 2, 3, 7]  # [1 2 3] at 0
    assert lookup([5, 2, 3, 9, 2, 3, 7, 4, 2, 3], 2, 1, 3) == [9, 2]  # [2 3], its first match
    assert lookup([5, 6, 7, 6], 3, 1, 3) == [7, 6]  # [6]: as many as follow
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []
    assert lookup([1, 2, 3, 4, 2], 3, 2, 3) == []  # a one-token match is below ngram_min
    assert lookup([4, 4, 4, 4], 8, 1, 3) == [4]  # the suffix itself is no match


def test_rollback_gives_the_blocks_back(tiny):
    layout = KVLayout.plan(tiny.config, 256, 2, 16, block_size=4)
    kv = KVCacheManager(layout)
    free = (kv.global_pool.available, kv.local_pool.available)
    assert kv.admit(0, 64) == 0
    kv.prepare(0, 0, 10)
    kv.commit(0, 10, lambda a, b: list(range(a, b)))
    kv.prepare(0, 10, 9)  # drafts up to position 18: blocks 2..4
    assert len(kv.tables(0).global_table) == 5
    kv.rollback(0, 11)  # keeps 0..10: blocks 0..2
    assert len(kv.tables(0).global_table) == 3
    kv.prepare(0, 11, 2)
    kv.release(0)
    assert (kv.global_pool.available, kv.local_pool.available) == free
    assert kv.admit(1, 64) == 0
    kv.prepare(1, 0, 12)
    kv.commit(1, 12, lambda a, b: list(range(a, b)))
    with pytest.raises(ValueError, match="registered"):
        kv.rollback(1, 7)


# -- the engine: the same answers --------------------------------------------------------------------------
def test_greedy_identical_with_and_without_speculation(tiny):
    off, on, st = both(tiny, lambda: requests(prompts(4), GREEDY))
    assert on == off
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st
    assert st["drafted"] == st["accepted"] + st["rolled_back"]
    assert 0 < st["acceptance_rate"] < 1


def test_sampled_identical_for_a_seed(tiny):
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.01, max_tokens=20, seed=11)
    params.logit_bias = {40: 2.0}
    params.presence_penalty, params.repetition_penalty = 0.3, 1.1

    def make():
        reqs = requests(prompts(3, seed=5), params)
        for r in reqs:
            r.params.seed = 100 + r.id
        return reqs

    off, on, st = both(tiny, make)
    assert on == off
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st


def exact_distribution(model, prompt: list[int], params: SamplingParams, n: int) -> dict:
    """The target's probability of every continuation of ``n`` tokens under ``params`` (top-k,
    temperature, repetition penalty), by teacher forcing: each prefix's last logits row through the
    request's own ``Sampler.prepare`` (the penalty), then its top-k and a float64 softmax."""
    out = {}
    sampler = Sampler(params)

    def walk(prefix: list[int], p: float, depth: int) -> None:
        if depth == n:
            out[tuple(prefix[len(prompt) :])] = p
            return
        row = sampler.prepare(forward_full(model, prefix)[-1], prefix, prefix[len(prompt) :])
        ids = np.argsort(-row, kind="stable")[: params.top_k]
        logits = row[ids].astype(np.float64)
        w = np.exp((logits - logits.max()) / params.temperature)
        for t, q in zip(ids.tolist(), (w / w.sum()).tolist(), strict=True):
            walk([*prefix, t], p * q, depth + 1)

    walk(list(prompt), 1.0, 0)
    return out


def test_sampled_distribution_is_the_targets(tmp_path):
    """1024 draws of 3 tokens with speculation (top_k 2: 8 outcomes; a repetition penalty of 4 flattens
    the tiny model's preference for its last token, so drafts are both kept and rejected), against the
    exact distribution from teacher forcing: total variation under TV_BOUND and a chi-square test at
    p = 0.001 (seeds 0..1023, so the result is fixed; the statistics are printed). A sampler that kept
    every draft its draw did not pick would move about half of the drafted rows' mass (TV ~0.2)."""
    model = load_model(make_tiny_gguf(tmp_path / "tiny.gguf", seed=7), backend="cpu")  # plain: faster
    r = np.random.default_rng(0)
    a, x = r.integers(6, 300, 4).tolist(), int(r.integers(6, 300))
    prompt = [2, *a, x, x, x, *a[:2], x]
    params = SamplingParams(temperature=2.0, top_k=2, max_tokens=3, repetition_penalty=4.0)
    exact = exact_distribution(model, prompt, params, 3)
    n, batch = 1024, 128
    cfg = SchedulerConfig(max_seqs=batch, kv_tokens=8192, block_size=4)
    cfg.speculation = SpeculationConfig(mode="lookup", max_batch=batch)
    sched = Scheduler(model, cfg)
    run_all(sched, [Request(n, list(prompt), dataclasses.replace(params))])  # its blocks cached for the rest
    counts: dict = {}
    for start in range(0, n, batch):
        reqs = [
            Request(i, list(prompt), dataclasses.replace(params, seed=i)) for i in range(start, start + batch)
        ]
        for ids, *_ in answers(run_all(sched, reqs)).values():
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    st = sched.status()["speculation"]
    assert st["accepted"] > 50 and st["rolled_back"] > 50, st
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    p = np.array([exact[k] for k in keys])
    f = np.array([counts.get(k, 0) for k in keys]) / n
    tv = 0.5 * np.abs(p - f).sum()
    big = n * p >= 5  # chi-square over the cells expected 5+ times, the rest pooled
    obs = np.append(f[big] * n, f[~big].sum() * n)
    exp = np.append(p[big] * n, p[~big].sum() * n)
    keep = exp > 0
    chi2 = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    print(f"tv {tv:.4f}, chi2 {chi2:.1f} on {dof} dof, {st}")
    assert tv < TV_BOUND, (tv, counts, exact)
    z = 3.09  # the 0.999 quantile of chi-square on dof degrees (Wilson-Hilferty): p < 0.001 fails
    assert chi2 < dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3, (chi2, dof)


def test_plain_mode_teacher_forced(tmp_path):
    """Without deterministic mode a step of drafts sums in another order than a step of one token (as
    batches do): every greedy token of a speculating run is the argmax of the sequence's own logits
    computed in one pass (teacher forced), or within 1e-4 of its scale of it (a near tie)."""
    model = load_model(make_tiny_gguf(tmp_path / "tiny.gguf", seed=7), backend="cpu")
    events, sched = run(model, requests(prompts(4), GREEDY), LOOKUP)
    st = sched.status()["speculation"]
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st
    assert_teacher_forced(model, events, prompts(4))


def assert_teacher_forced(model, events: dict, ps: list[list[int]], rel: float = 1e-4) -> None:
    """Every greedy token in ``events`` (request i's prompt ``ps[i]``) is the argmax of its sequence's
    logits computed in one pass on ``model`` (teacher forced), or within ``rel`` of the row's scale of it."""
    for rid, (ids, *_) in answers(events).items():
        prompt = ps[rid]
        rows = forward_full(model, prompt + ids[:-1])[len(prompt) - 1 :]
        for j, (row, tok) in enumerate(zip(rows, ids, strict=True)):
            gap = row.max() - row[tok]
            assert gap <= rel * np.abs(row).max(), (rid, j, tok, int(row.argmax()), gap)


def test_stop_strings_and_max_tokens(tiny):
    ps = prompts(4, seed=20)
    base, _ = run(tiny, requests(ps, GREEDY), SpeculationConfig())
    texts = [answers(base)[i][1] for i in range(4)]

    def make():
        reqs = requests(ps, GREEDY)
        for r, t in zip(reqs, texts, strict=True):
            r.params.stop = [t[7:9]] if len(t) > 9 else []  # cut inside the answer
        reqs[3].params.stop, reqs[3].params.max_tokens = [], 5  # a draft would run past it
        return reqs

    off, on, st = both(tiny, make)
    assert on == off
    assert st["accepted"] > 0, st
    assert {a[3] for a in on.values()} == {"stop", "length"}


def test_json_schema_beside_speculating_requests(tiny):
    """A json_schema request speculates too, each row masked by the grammar's state after the tokens kept
    before it: its prompt holds "{" followed by tokens the grammar forbids (drafted, rejected), then "{ }"
    (the tiny model's answer under this schema: drafted, kept)."""
    grammar = compile_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    prompt = [2, 129, 50, 51, 52, 7, 129, 262, 131, 9, 10, 11]
    for params in (GREEDY, SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=3)):

        def alone(params=params):
            return [Request(0, list(prompt), dataclasses.replace(params), grammar=grammar)]

        def beside(params=params):
            reqs = requests(prompts(3, seed=30), GREEDY)
            return [*reqs, Request(3, list(prompt), dataclasses.replace(params), grammar=grammar)]

        off, on, st = both(tiny, alone)
        assert on == off and on[0][1] == "{ }"
        assert st["accepted"] > 0 and st["rolled_back"] > 0, st
        off, on, st = both(tiny, beside)
        assert on == off


def test_cancel_mid_speculation(tiny):
    seen = []

    def cancel_once_speculating(sched):
        st = sched.speculator.stats
        if st.accepted and not seen:
            seen.append(st.steps)
            sched.cancel(1)

    events, sched = run(tiny, requests(prompts(3, seed=40), GREEDY), LOOKUP, on_step=cancel_once_speculating)
    got = answers(events)
    assert seen and got[1][2] == "cancelled" and got[0][2] == got[2][2] == "done"
    assert_no_blocks_held(sched)


def test_off_per_request_and_past_max_batch(tiny):
    _, sched = run(tiny, requests(prompts(3), GREEDY, speculate=False), LOOKUP)
    assert sched.status()["speculation"]["drafted"] == 0
    _, sched = run(tiny, requests(prompts(3), GREEDY), SpeculationConfig(mode="lookup", max_batch=2))
    assert sched.status()["speculation"]["drafted"] == 0  # 3 running: the whole time
    logprobs = dataclasses.replace(GREEDY, logprobs=2)
    _, sched = run(tiny, requests(prompts(2), logprobs), LOOKUP)
    assert sched.status()["speculation"]["drafted"] == 0


def test_prefix_cache_holds_only_kept_tokens(tiny):
    """A second run of the same prompts reuses the first's blocks (prompt and answer): with speculation
    they must hold what a run without it would, so the answers stay the same."""
    ps = prompts(2, seed=50)
    first, sched = run(tiny, requests(ps, GREEDY), LOOKUP)
    answers_first = answers(first)
    again = [p + answers_first[i][0][:-1] for i, p in enumerate(ps)]  # a follow-up over the whole answer
    reqs = requests(again, dataclasses.replace(GREEDY, max_tokens=8))
    events = run_all(sched, reqs)
    assert all(r.n_reused > 0 for r in reqs)
    off, _ = run(tiny, requests(again, dataclasses.replace(GREEDY, max_tokens=8)), SpeculationConfig())
    assert answers(events) == answers(off)
    assert_no_blocks_held(sched)


# -- a real daemon -------------------------------------------------------------------------------------------
def test_daemon_with_speculation_answers_concurrent_requests(tmp_path):
    """A real hmad (cpu, deterministic, speculation.mode=lookup) on its socket: 6 clients at once, each
    prompt sent with and without ``speculate``; the same answers, each request one terminal reply
    (Client.generate raises on anything else), status showing drafts kept and rolled back, no block held."""
    from hmaclient import Client

    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=7)
    d = Daemon(path, tmp_path, "engine.deterministic=true", "speculation.mode=lookup", backend="cpu")
    words = ["the cat and the dog", "hello world of the model", "it is that in the", "dog cat dog cat"]
    texts = [f"{w} {w} {w} {w.split()[0]}" for w in words]
    try:
        d.wait_ready()
        out = ask_with_and_without(d.socket, texts, 24)
        with Client(d.socket, timeout=30) as c:
            st = c.status()
            metrics = {f["name"]: f for f in c.metrics()}
    finally:
        assert d.stop() == 0, d.log_text()
    for i in range(len(texts)):
        assert out[i, True] == out[i, False], i
    spec = st["speculation"]
    assert spec["mode"] == "lookup" and spec["accepted"] > 0 and spec["rolled_back"] > 0, spec
    assert st["kv"]["global_blocks_used"] == 0 and st["kv"]["sequences"] == 0
    assert metrics["speculation_accepted_tokens"]["samples"][0]["value"] == spec["accepted"]
    assert metrics["speculation_rolled_back_tokens"]["samples"][0]["value"] == spec["rolled_back"]


def ask_with_and_without(socket: str, texts: list[str], max_tokens: int) -> dict:
    """Each text sent twice at once, with and without ``speculate``, greedy and raw, every request from a
    thread of its own: {(i, speculate): (token ids, text, finish reason)}; the first exception a request
    raised (Client.generate raises on anything but one ``done``) is raised here."""
    from hmaclient import Client

    out: dict = {}

    def ask(i: int, speculate: bool) -> None:
        with Client(socket, timeout=120) as c:
            r = c.generate(texts[i], raw=True, max_tokens=max_tokens, temperature=0.0, speculate=speculate)
            out[i, speculate] = (r.token_ids, r.text, r.finish_reason)

    run_in_threads(ask, [(i, s) for i in range(len(texts)) for s in (True, False)])
    return out


def test_protocol_speculate_field():
    """``generate.speculate``: a bool since version 5 (hmaclient stamps v5 when it is used)."""
    from hmaclient import protocol as P

    msg = P.generate_request(1, "x", speculate=False)
    assert msg["v"] == 5 and P.validate_request(msg).speculate is False
    assert P.validate_request({"v": 5, "type": "generate", "prompt": "x"}).speculate is True
    with pytest.raises(P.ProtocolError, match="version 5"):
        P.validate_request({"v": 4, "type": "generate", "prompt": "x", "speculate": False})
    with pytest.raises(P.ProtocolError, match="bool"):
        P.validate_request({"v": 5, "type": "generate", "prompt": "x", "speculate": 1})


def test_config_section(monkeypatch, tmp_path):
    """``speculation:``: off by default (YAML's bare off too), its keys checked, and the scheduler's."""
    from hmad import config as config_mod
    from hmad.config import ConfigError, load_config

    monkeypatch.setattr(config_mod, "SYSTEM_CONFIG", str(tmp_path / "absent.yaml"))  # never the machine's

    cfg = load_config(None, env={})
    assert cfg.scheduler_config().speculation == SpeculationConfig() and not SpeculationConfig().on
    cfg = load_config(None, {"speculation": {"mode": False, "k_max": 4}}, env={})  # `mode: off` in YAML
    assert cfg.scheduler_config().speculation == SpeculationConfig(mode="off", k_max=4)
    cfg = load_config(None, {"speculation.mode": "lookup", "speculation.max_batch": 2}, env={})
    assert cfg.scheduler_config().speculation == SpeculationConfig(mode="lookup", max_batch=2)
    with pytest.raises(ConfigError, match="speculation.mode"):
        load_config(None, {"speculation.mode": "medusa"}, env={})
    with pytest.raises(ConfigError, match="speculation.ngram_max"):
        load_config(None, {"speculation.ngram_min": 3, "speculation.ngram_max": 2}, env={})
