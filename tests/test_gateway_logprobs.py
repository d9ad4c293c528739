"""Logprobs through hmad-openai (chat ``logprobs``/``top_logprobs``, completions ``logprobs`` and ``echo``,
Responses ``include``/``top_logprobs``, Ollama ``logprobs``/``top_logprobs``), with the official ``openai``
and ``ollama`` clients against a real gateway in front of a real hmad on a tiny random GGUF:
each value equals what hmaclient gets for the same greedy request, streamed and whole; an
lm-evaluation-harness-shaped request (``echo: true, logprobs: 1, max_tokens: 0`` on context +
continuation) scores the continuation as hmaclient's prompt_logprobs do.
"""

from __future__ import annotations

import math

import gateway_harness as harness
import httpx
import openai
import pytest
from gateway_harness import KEY

from hmaclient import Client

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures

MESSAGES = [{"role": "user", "content": "x b"}]
CLOSE = 1e-6


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _assert_chat_entries(content, ref, rel: float = 0.0) -> None:
    """OpenAI's entries equal hmaclient's (values within ``rel`` relative, else CLOSE)."""
    assert [e.token for e in content] == [e.text for e in ref]
    for got, want in zip(content, ref, strict=True):
        assert math.isclose(got.logprob, want.logprob, rel_tol=rel, abs_tol=CLOSE)
        assert got.bytes == list(want.text.encode())
        assert [(t.token, t.bytes) for t in got.top_logprobs] == [
            (t, list(t.encode())) for _i, _lp, t in want.top
        ]
        assert all(
            math.isclose(t.logprob, lp, rel_tol=rel, abs_tol=CLOSE)
            for t, (_i, lp, _t) in zip(got.top_logprobs, want.top, strict=True)
        )
        assert len(got.top_logprobs) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_equal_hmaclient(oai, hmad, stream):
    args = {"model": "any", "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True}
    with Client(hmad.socket) as c:
        ref = c.generate(messages=MESSAGES, max_tokens=5, temperature=0, logprobs=3)
    assert ref.logprobs and len(ref.logprobs) == len(ref.token_ids)
    if stream:
        chunks = list(oai.chat.completions.create(**args, top_logprobs=3, stream=True))
        content = [
            e
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content
        ]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    else:
        r = oai.chat.completions.create(**args, top_logprobs=3)
        assert r.choices[0].message.content == ref.text
        content = r.choices[0].logprobs.content
    _assert_chat_entries(content, ref.logprobs)


def test_chat_without_logprobs_has_none(oai, hmad):
    r = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=False
    )
    assert r.choices[0].logprobs is None


def test_chat_logprobs_with_n(oai, hmad):
    r = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3, n=2
    )
    with Client(hmad.socket) as c:
        ref = c.generate(messages=MESSAGES, max_tokens=3, temperature=0, logprobs=3)
    assert len(r.choices) == 2
    for choice in r.choices:
        _assert_chat_entries(choice.logprobs.content, ref.logprobs, rel=1e-4)  # batched: float order


@pytest.mark.parametrize("top", [21, -1])
def test_bad_top_logprobs_is_400(oai, hmad, top):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="any", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=top
        )
    assert info.value.body["param"] == "top_logprobs"
    assert "top_logprobs must be" in info.value.body["message"]


def test_bad_completions_logprobs_is_400(oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt="x b", max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_equal_hmaclient(oai, hmad, stream):
    args = {"model": "any", "prompt": "x b", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    with Client(hmad.socket) as c:
        ref = c.generate(prompt="x b", raw=True, max_tokens=4, temperature=0, logprobs=2)
    if stream:
        chunks = [ch.choices[0] for ch in oai.completions.create(**args, stream=True) if ch.choices]
        tokens = [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens]
        values = [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs]
        tops = [t for ch in chunks if ch.logprobs for t in ch.logprobs.top_logprobs]
        offsets = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset]
        assert "".join(ch.text for ch in chunks) == ref.text
    else:
        [choice] = oai.completions.create(**args).choices
        assert choice.text == ref.text
        lp = choice.logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert tokens == [e.text for e in ref.logprobs]
    assert all(math.isclose(v, e.logprob, abs_tol=CLOSE) for v, e in zip(values, ref.logprobs, strict=True))
    assert [sorted(t) for t in tops] == [sorted({x for _i, _lp, x in e.top}) for e in ref.logprobs]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_echo_without_logprobs_prepends_the_prompt(oai, hmad):
    [choice] = oai.completions.create(
        model="any", prompt="x b", max_tokens=3, temperature=0, echo=True
    ).choices
    with Client(hmad.socket) as c:
        ref = c.generate(prompt="x b", raw=True, max_tokens=3, temperature=0)
    assert choice.text == "x b" + ref.text and choice.logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(oai, hmad, max_tokens):
    """lm-evaluation-harness's local-completions: context + continuation, echo, logprobs 1; it sums
    token_logprobs[ctxlen:-1] (max_tokens 1) or from ctxlen (max_tokens 0)."""
    context, continuation = "a x b", " b b"
    prompt = context + continuation
    [choice] = oai.completions.create(
        model="any", prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    ).choices
    with Client(hmad.socket) as c:
        ref = c.generate(prompt=prompt, raw=True, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
        ctxlen = c.generate(prompt=context, raw=True, max_tokens=1).prompt_tokens  # the context's tokens
    n_prompt = len(ref.prompt_logprobs)
    assert ref.prompt_logprobs[0] is None and n_prompt == ref.prompt_tokens and 1 < ctxlen < n_prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, want in zip(lp.token_logprobs[1:n_prompt], ref.prompt_logprobs[1:], strict=True):
        assert math.isclose(got, want.logprob, abs_tol=CLOSE)
    assert choice.text == (prompt if max_tokens == 0 else prompt + ref.text)
    assert "".join(lp.tokens[:n_prompt]) == prompt  # the first (BOS) token's text is empty
    assert "".join(lp.tokens[ctxlen:n_prompt]) == continuation
    # the continuation's score as the harness sums it
    got = sum(lp.token_logprobs[ctxlen : ctxlen + n_prompt - ctxlen])
    assert math.isclose(got, sum(e.logprob for e in ref.prompt_logprobs[ctxlen:]), abs_tol=1e-5)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    if max_tokens == 1:
        assert math.isclose(lp.token_logprobs[-1], ref.logprobs[0].logprob, abs_tol=CLOSE)


def test_max_tokens_0_without_echo_is_400(oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt="x b", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_echo_with_stream_is_400(oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt="x b", max_tokens=2, echo=True, stream=True)
    assert info.value.body["param"] == "echo"


# -- the Responses and Ollama APIs ---------------------------------------------------------------------------


def _assert_entries(got: list, ref, top: int) -> None:
    """Responses' and Ollama's entries ({token, logprob, bytes, top_logprobs}, objects or dicts) equal
    hmaclient's."""

    def field(e, name):
        return e[name] if isinstance(e, dict) else getattr(e, name)

    assert [field(e, "token") for e in got] == [e.text for e in ref]
    for e, want in zip(got, ref, strict=True):
        assert math.isclose(field(e, "logprob"), want.logprob, abs_tol=CLOSE)
        alts = [(field(t, "token"), field(t, "logprob")) for t in field(e, "top_logprobs")]
        assert len(alts) == top and [t for t, _ in alts] == [t for _i, _lp, t in want.top]
        pairs = zip(alts, want.top, strict=True)
        assert all(math.isclose(lp, w, abs_tol=CLOSE) for (_, lp), (_i, w, _t) in pairs)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_logprobs_equal_hmaclient(oai, hmad, stream):
    with Client(hmad.socket) as c:
        ref = c.generate(messages=MESSAGES, max_tokens=5, temperature=0, logprobs=2)
    args = {"model": "any", "input": MESSAGES, "max_output_tokens": 5, "temperature": 0, "top_logprobs": 2}
    args["include"] = ["message.output_text.logprobs"]
    if stream:
        events = list(oai.responses.create(**args, stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert "".join(e.delta for e in deltas) == ref.text
        _assert_entries([lp for e in deltas for lp in e.logprobs], ref.logprobs, 2)
        [done] = [e for e in events if e.type == "response.output_text.done"]
        _assert_entries(done.logprobs, ref.logprobs, 2)
        r = events[-1].response
    else:
        r = oai.responses.create(**args)
    assert r.output_text == ref.text
    _assert_entries(r.output[0].content[0].logprobs, ref.logprobs, 2)


@pytest.mark.parametrize("chat", [False, True])
def test_ollama_logprobs_equal_hmaclient(gateway, hmad, chat):
    import ollama

    client = ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    opts = {"temperature": 0, "num_predict": 5}
    with Client(hmad.socket) as c:
        ref = c.generate(**({"messages": MESSAGES} if chat else {"prompt": "x b", "raw": True}), max_tokens=5,
                         temperature=0, logprobs=3)  # fmt: skip
    for stream in (False, True):
        if chat:
            out = client.chat(model="any", messages=MESSAGES, options=opts, stream=stream, logprobs=True,
                              top_logprobs=3)  # fmt: skip
        else:
            out = client.generate(model="any", prompt="x b", raw=True, options=opts, stream=stream,
                                  logprobs=True, top_logprobs=3)  # fmt: skip
        parts = list(out) if stream else [out]
        text = "".join(p.message.content if chat else p.response for p in parts)
        assert text == ref.text
        _assert_entries([lp for p in parts for lp in (p.logprobs or [])], ref.logprobs, 3)


def test_bad_top_logprobs_is_400_on_responses_and_ollama(gateway, oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="any", input="x b", top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"
    body = {"model": "any", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}
    r = httpx.post(gateway.url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"}, json=body)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]
