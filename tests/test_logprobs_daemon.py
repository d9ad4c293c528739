"""Logprobs through a real hmad on a real socket (the numpy backend, a tiny model): logprobs=0 and =5,
streamed and whole; each token's logprob equals the numpy reference computed from ``forward_full``'s
logits at its position; greedy's token is its own top-1; values <= 0, the top list sorted; bad values get
one bad_request each and the daemon answers the next request."""

from __future__ import annotations

import math

import numpy as np
import pytest
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P
from hmad.composition import load_model
from hmad.engine.generate import forward_full

PROMPT = "hello there"
ASK = dict(prompt=PROMPT, raw=True, max_tokens=6)
# relative to the value: the daemon's rows come from its decode steps, the reference's from one pass over the
# whole sequence; the tiny model's logits reach ~100, where float32's rounding is ~1e-5
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5)
    d = Daemon(path, tmp_path_factory.mktemp("hmad")).wait_ready()
    yield d, load_model(path, "cpu")
    assert d.stop() == 0, d.log_text()


def _reference(model, ids: list[int], bias: dict[int, float]) -> np.ndarray:
    """Log-softmax (float64) of the logits rows that produced each generated token of ``ids``, ``bias``
    added: rows len(prompt)-1 .. end-1 of one forward pass over the whole sequence (prompt first)."""
    prompt = model.tokenizer.encode(PROMPT)
    logits = forward_full(model, prompt + ids[:-1])[len(prompt) - 1 :]
    for t, b in bias.items():
        logits[:, t] += np.float32(b)
    logits = logits.astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _check(model, token_ids, entries, n: int, greedy: bool, bias: dict[int, float] | None = None) -> None:
    assert token_ids and [e.token_id for e in entries] == token_ids
    ref = _reference(model, token_ids, bias or {})
    for pos, e in enumerate(entries):
        assert e.logprob <= 0 and _close(e.logprob, ref[pos, e.token_id]), (pos, e.logprob)
        assert e.text == model.tokenizer.token_bytes(e.token_id, True).decode("utf-8", "replace")
        assert len(e.top) == n
        values = [lp for _, lp, _ in e.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        want = np.argsort(-ref[pos], kind="stable")[:n].tolist()
        assert [i for i, _, _ in e.top] == want or all(map(_close, values, ref[pos, want]))
        for i, lp, _ in e.top:
            assert _close(lp, ref[pos, i])
        if greedy and n:
            assert e.top[0][0] == e.token_id


@pytest.mark.parametrize("n", [0, 5])
def test_whole_and_streamed_logprobs_equal_the_numpy_reference(setup, n):
    hmad, model = setup
    with Client(hmad.socket, timeout=60) as c:
        whole = c.generate(**ASK, temperature=0.0, logprobs=n)
        _check(model, whole.token_ids, whole.logprobs, n, greedy=True)
        gen = c.stream(**ASK, temperature=0.0, logprobs=n)
        pieces = []
        try:
            while True:
                pieces.append(next(gen))
        except StopIteration as stop:
            streamed = stop.value
        assert [e for p in pieces for e in p.logprobs or []] == streamed.logprobs
        assert all([e.token_id for e in p.logprobs or []] == p.token_ids for p in pieces)  # one per id
        assert streamed.token_ids == whole.token_ids
        assert [(e.token_id, e.logprob) for e in streamed.logprobs] == [
            (e.token_id, e.logprob) for e in whole.logprobs
        ]
        plain = c.generate(**ASK, temperature=0.0)  # none asked: none sent, the same tokens
        assert plain.logprobs is None and plain.token_ids == whole.token_ids


def test_sampled_tokens_report_the_adjusted_rows_distribution(setup):
    """The tiny model's answer is near certain (its runner-up ~100 nats behind): a +100 logit_bias on the
    first token's runners-up makes a real distribution. A temperature-0.7, top-k 3 draw from it reports
    the adjusted row's log-softmax over the whole vocabulary, not the truncated sampler's."""
    hmad, model = setup
    with Client(hmad.socket, timeout=60) as c:
        first = c.generate(**ASK, temperature=0.0, logprobs=5).logprobs[0]
        bias = {i: 100.0 for i, _, _ in first.top[1:4]}
        r = c.generate(**ASK, temperature=0.7, top_k=3, seed=11, logprobs=3, logit_bias=bias)
    _check(model, r.token_ids, r.logprobs, 3, greedy=False, bias=bias)
    assert any(e.top[1][1] > -20 for e in r.logprobs)  # the bias made alternatives near the top
    assert all(math.fsum(math.exp(lp) for _, lp, _ in e.top) < 1.0 + 1e-9 for e in r.logprobs)


def test_bad_logprobs_get_one_bad_request_and_the_next_request_is_answered(setup):
    hmad, _ = setup
    for i, bad in enumerate([-1, 21, "5"]):
        msg = {"v": 3, "type": "generate", "id": f"bad{i}", "prompt": "hi", "logprobs": bad}
        reply = P.parse_reply(hmad._ask(msg, 10.0))
        assert isinstance(reply, P.Error) and reply.code == P.BAD_REQUEST, reply
        assert (
            reply.message.startswith("logprobs must be an integer from 0 to 20") and "\n" not in reply.message
        )
        with Client(hmad.socket, timeout=60) as c:
            assert c.generate(**ASK, temperature=0.0, logprobs=1).logprobs


def test_a_grammars_forbidden_tokens_are_never_alternatives(setup):
    """With json_schema the row is masked: every listed alternative is a token the grammar allowed there
    (finite), so the top list may be shorter than asked; the probabilities listed sum to at most 1."""
    hmad, _ = setup
    with Client(hmad.socket, timeout=60) as c:
        r = c.generate(**ASK, temperature=0.0, logprobs=20, json_schema={"type": "boolean"})
    assert r.text in ("true", "false") and len(r.logprobs) == len(r.token_ids)
    for e in r.logprobs:
        assert math.isfinite(e.logprob) and all(math.isfinite(lp) for _, lp, _ in e.top)
        assert e.top[0][0] == e.token_id and math.fsum(math.exp(lp) for _, lp, _ in e.top) <= 1 + 1e-9
    assert any(len(e.top) < 20 for e in r.logprobs)  # the mask left fewer than 20 tokens somewhere


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_equal_the_numpy_reference(setup, stream):
    """Each prompt token's logprob given the tokens before it (the first has none: nil), on done, streamed
    or not; asked twice, the second answer is the same (the prefix cache holds no logits rows)."""
    hmad, model = setup
    prompt = model.tokenizer.encode(PROMPT)
    logits = forward_full(model, prompt).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    with Client(hmad.socket, timeout=60) as c:
        runs = []
        for _ in range(2):
            if stream:
                gen = c.stream(**ASK, temperature=0.0, prompt_logprobs=4)
                r = None
                try:
                    while True:
                        next(gen)
                except StopIteration as stop:
                    r = stop.value
            else:
                r = c.generate(**ASK, temperature=0.0, prompt_logprobs=4)
            runs.append(r.prompt_logprobs)
            assert r.logprobs is None  # (only the prompt's asked for)
    entries = runs[0]
    assert len(entries) == len(prompt) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i] and _close(e.logprob, ref[i - 1, prompt[i]]), (i, e)
        assert [t for t, _, _ in e.top] == np.argsort(-ref[i - 1], kind="stable")[:4].tolist()
        assert all(_close(lp, ref[i - 1, t]) for t, lp, _ in e.top)
    assert [(e.token_id, e.logprob) for e in runs[1][1:]] == [(e.token_id, e.logprob) for e in entries[1:]]


def test_a_long_prompts_logprobs_span_its_chunks(setup):
    """A prompt past one prompt-logprobs chunk (planning.PROMPT_ROWS_MAX) has an entry for every token."""
    from hmad.engine.planning import PROMPT_ROWS_MAX

    hmad, model = setup
    text = "hello there " * 30
    prompt = model.tokenizer.encode(text)
    assert len(prompt) > PROMPT_ROWS_MAX + 1
    logits = forward_full(model, prompt).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    with Client(hmad.socket, timeout=60) as c:
        entries = c.generate(prompt=text, raw=True, max_tokens=1, prompt_logprobs=0).prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    assert all(e.top == [] and _close(e.logprob, ref[i - 1, prompt[i]]) for i, e in enumerate(entries[1:], 1))
