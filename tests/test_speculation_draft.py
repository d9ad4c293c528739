"""Speculative decoding with a draft model (docs/speculation.md, "A draft model"): the same answers with and
without it, the draft's KV cache in step with each sequence and given back, a vocabulary mismatch refused.

A real engine on tiny GGUFs (tests/tiny_gguf.py) with ``deterministic`` on. A tiny random model repeats its
last token (its token embeddings outweigh its layers), so a draft that is the target itself, or another
seed of it, agrees with it everywhere: every draft kept. ``wayward`` writes a draft whose embeddings are
small against its layers: it wanders off, and the target rejects most of its drafts.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import tiny_gguf
from daemon_harness import Daemon
from test_speculation import (
    GREEDY,
    answers,
    ask_with_and_without,
    assert_no_blocks_held,
    prompts,
    requests,
    run,
    run_all,
)
from tiny_gguf import make_tiny_gguf

from hmad.composition import load_draft, load_model
from hmad.core.errors import ModelFormatError
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig
from hmad.engine.speculation import SpeculationConfig
from hmad.engine.speculation.draft_model import DraftModelDrafter, check_vocabulary

DRAFT = SpeculationConfig(mode="draft", max_batch=8)


def wayward(path, seed: int = 8):
    """A tiny model whose token embeddings are a tenth of the usual scale: it does not repeat its input."""
    plain = tiny_gguf._weight

    def weight(rng, shape, qtype, scale):
        return plain(rng, shape, qtype, 0.05 if scale == 0.5 else scale)  # (0.5: token_embd's)

    with mock.patch.object(tiny_gguf, "_weight", weight):
        return make_tiny_gguf(path, seed=seed)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    return make_tiny_gguf(d / "tiny.gguf", seed=7), wayward(d / "wayward.gguf")


@pytest.fixture(scope="module")
def target(files):
    return load_model(files[0], backend="cpu", deterministic=True)


def with_draft(target, draft, make, max_seqs: int = 8):
    """The answers without speculation and with ``draft`` drafting, the speculating run's status, and its
    drafter (every KV block of target and draft given back: checked)."""
    off, _ = run(target, make(), SpeculationConfig(), max_seqs=max_seqs)
    cfg = SchedulerConfig(max_seqs=max_seqs, kv_tokens=4096, block_size=4, speculation=DRAFT)
    sched = Scheduler(target, cfg)
    drafter = DraftModelDrafter.attach(sched, draft)
    on = run_all(sched, make())
    assert_no_blocks_held(sched)
    u = drafter.kv.usage()
    assert u["global_blocks_used"] == 0 and u["local_blocks_used"] == 0 and u["sequences"] == 0, u
    assert drafter.kv.global_pool.promised == 0 and drafter.kv.local_pool.promised == 0 and not drafter.fed
    return answers(off), answers(on), sched.status()["speculation"]


def test_draft_is_the_target(target, files):
    """The target drafting for itself: the same answers, drafts kept (a step's whole k, k at k_max)."""
    draft = load_model(files[0], backend="cpu", deterministic=True)
    off, on, st = with_draft(target, draft, lambda: requests(prompts(4), GREEDY))
    assert on == off
    assert st["accepted"] > 0 and st["acceptance_rate"] == 1.0, st
    assert st["draft"]["model"] == str(files[0]) and st["draft"]["steps"] > 0


def test_draft_that_disagrees(target, files):
    """A draft of another seed and scale: most drafts rejected and rolled back (in the target's cache and the
    draft's), the answers still the target's, greedy and seeded sampled."""
    draft = load_model(files[1], backend="cpu", deterministic=True)
    off, on, st = with_draft(target, draft, lambda: requests(prompts(4), GREEDY))
    assert on == off
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st
    params = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=16)
    off, on, st = with_draft(target, draft, lambda: requests(prompts(3, seed=3), params), max_seqs=3)
    assert on == off
    assert st["rolled_back"] > 0, st


def test_long_prompt_caught_up_in_chunks(target, files):
    """A prompt longer than max_chunk reaches the draft's cache in chunks; a request with max_tokens 1
    and one with speculate false beside it are never drafted for."""
    draft = load_model(files[1], backend="cpu", deterministic=True)
    long = [2, *(list(range(10, 60)) * 3)]

    def make():
        reqs = requests([long, *prompts(2)], dataclasses.replace(GREEDY, max_tokens=10))
        reqs[1].params.max_tokens = 1
        reqs[2].speculate = False
        return reqs

    off, _ = run(target, make(), SpeculationConfig())
    cfg = SchedulerConfig(max_seqs=4, kv_tokens=4096, block_size=4, max_chunk=32, speculation=DRAFT)
    sched = Scheduler(target, cfg)
    drafter = DraftModelDrafter.attach(sched, draft)
    assert answers(run_all(sched, make())) == answers(off)
    assert sched.status()["speculation"]["drafted"] > 0 and drafter.steps > 5 and not drafter.fed


def test_cancel_and_a_growing_batch(target, files):
    """A request cancelled mid-speculation and others that speculate alone, then beside more than
    max_batch: the others' answers unchanged, every draft block given back (cancel and end alike)."""
    draft = load_model(files[1], backend="cpu", deterministic=True)
    seen = []

    def make():
        reqs = requests(prompts(5, seed=40), GREEDY)
        for r in reqs[2:]:
            r.params.max_tokens = 2  # these three end early: the batch shrinks to max_batch and below
        return reqs

    off, _ = run(target, make(), SpeculationConfig(), max_seqs=5)
    spec = SpeculationConfig(mode="draft", max_batch=2)
    cfg = SchedulerConfig(max_seqs=5, kv_tokens=4096, block_size=4, speculation=spec)
    sched = Scheduler(target, cfg)
    drafter = DraftModelDrafter.attach(sched, draft)

    def cancel_once(sched: Scheduler) -> None:  # request 1, at the first step that speculated
        if sched.speculator.stats.steps and not seen:
            seen.append(sorted(drafter.fed))
            sched.cancel(1)

    events = run_all(sched, make(), cancel_once)
    got, want = answers(events), answers(off)
    assert got[1][2] == "cancelled" and got[0] == want[0] and all(got[i] == want[i] for i in (2, 3, 4))
    assert seen == [[0, 1]], seen  # only the two left speculated
    assert_no_blocks_held(sched)
    assert drafter.kv.usage()["sequences"] == 0 and not drafter.fed and not drafter.sure


def test_vocabulary_mismatch_refused(files, tmp_path):
    """A draft of another vocabulary size, or of the same size with one token's text changed, is refused at
    load with a ModelFormatError naming both files; its backend closed."""
    target = load_model(files[0], backend="cpu")
    small = make_tiny_gguf(tmp_path / "small.gguf", byte_tokens=False)
    with pytest.raises(ModelFormatError, match="vocabulary sizes differ") as e:
        load_draft(small, target)
    assert str(small) in str(e.value) and str(files[0]) in str(e.value)
    with mock.patch.object(tiny_gguf, "WORDS", [*tiny_gguf.WORDS[:-1], "cow"]):
        other = make_tiny_gguf(tmp_path / "other.gguf")
    with pytest.raises(ModelFormatError, match="differs") as e:
        check_vocabulary(target, load_model(other, backend="cpu"))
    assert str(other) in str(e.value) and str(files[0]) in str(e.value) and "cow" in str(e.value)


def test_daemon_with_a_draft_model(files, tmp_path):
    """A real hmad (cpu, deterministic, speculation.mode=draft): 4 clients at once, each prompt with and
    without ``speculate``; the same answers, one terminal reply each (Client.generate raises on anything
    else); status shows the draft model's name, its memory and drafts kept and rejected; no block held."""
    from hmaclient import Client

    sets = ("engine.deterministic=true", "speculation.mode=draft", f"speculation.draft_model={files[1]}")
    d = Daemon(files[0], tmp_path, *sets, backend="cpu")
    texts = ["the cat and the dog", "hello world of the model"]
    try:
        d.wait_ready()
        out = ask_with_and_without(d.socket, texts, 16)
        with Client(d.socket, timeout=30) as c:
            st = c.status()
    finally:
        assert d.stop() == 0, d.log_text()
    for i in range(len(texts)):
        assert out[i, True] == out[i, False], i
    spec = st["speculation"]
    assert spec["mode"] == "draft" and spec["drafted"] > 0 and spec["rolled_back"] > 0, spec
    draft = spec["draft"]
    assert draft["model"] == str(files[1]) and draft["model_name"] == "tiny-gemma3-seed8", draft
    assert sum(draft["memory"].values()) > 0 and draft["sequences"] == 0, draft
    assert st["kv"]["global_blocks_used"] == 0 and st["kv"]["sequences"] == 0


def test_switching_models_keeps_the_draft_and_refuses_a_mismatch(files, tmp_path):
    """hmactl load with a draft model configured: the new model gets the draft too (the old one, draft and
    all, released); a model of another vocabulary fails to load, its error naming both files, and the
    model before it serves on."""
    from test_switch import load

    from hmaclient import Client

    other = make_tiny_gguf(tmp_path / "other.gguf", seed=9)
    small = make_tiny_gguf(tmp_path / "small.gguf", byte_tokens=False)
    sets = ("speculation.mode=draft", f"speculation.draft_model={files[1]}")
    d = Daemon(files[0], tmp_path, *sets, backend="cpu").wait_ready(60)
    try:
        with Client(d.socket, timeout=60) as c:
            sw, _ = load(c, other)
            assert sw["state"] == "ready" and sw["previous_released"] is True, sw
            c.generate("the cat and the dog the cat", raw=True, max_tokens=8, temperature=0.0)
            spec = c.status()["speculation"]
            assert spec["draft"]["model"] == str(files[1]) and spec["drafted"] > 0, spec
            sw, _ = load(c, small)
            assert sw["state"] == "ready" and sw["model"] == str(other), sw
            assert "small.gguf" in sw["error"] and "wayward.gguf" in sw["error"], sw
            assert "vocabulary" in sw["error"], sw
            r = c.generate("the cat and the dog the cat", raw=True, max_tokens=8, temperature=0.0)
            assert r.finish_reason in ("length", "stop")
    finally:
        assert d.stop() == 0, d.log_text()
