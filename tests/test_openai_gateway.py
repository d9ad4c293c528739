"""hmad-openai: the official ``openai`` client (and raw HTTP through httpx) against a real gateway process
(``python -m hmad_openai`` on 127.0.0.1, a free port) in front of a real hmad on a tiny random GGUF
(daemon_harness.py, tiny_gguf.py).

Answers are checked against what hmad gives hmaclient directly for the same request: the gateway adds no
text of its own. The tiny model repeats a raw prompt's last token ("x b" -> " b b b ..."), so a raw prompt
with a large max_tokens makes a generation that runs for seconds (the disconnect and busy tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from daemon_harness import Daemon
from gateway_harness import Gateway
from prometheus_client.parser import text_string_to_metric_families
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, RequestCancelled
from hmaclient import protocol as P

KEY = "sk-test-0123456789"
WEB_ORIGIN = "http://localhost:3000"
TINY_NAME = "tiny-gemma3-seed5"
CLEAN_EXIT = (0, -signal.SIGTERM)
HAS_JSON_SCHEMA = "json_schema" in {f.name for f in dataclasses.fields(P.GenerateRequest)}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    # max_seqs 2 + max_queue 1: a fourth generation in flight is refused as busy (test_busy_is_429)
    d = Daemon(tiny_path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2", "engine.max_queue=1")
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "key").write_text(KEY + "\n")
    g = Gateway(daemon.socket, tmp, "--api-key-file", str(tmp / "key"), "--cors-origin", WEB_ORIGIN)
    yield g
    assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


@pytest.fixture
def hmad(daemon, gateway):
    """The module's daemon; after the test nothing may still run in it (every generation ended or was
    cancelled)."""
    yield daemon
    assert daemon.proc.poll() is None, daemon.log_text()
    assert gateway.proc.poll() is None, gateway.log_path.read_text()
    with Client(daemon.socket) as c:
        _wait(lambda: _load(c) == (0, 0, 0))


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        yield h


def _load(c: Client) -> tuple[int, int, int]:
    st = c.status()
    return st["running"], st["queued"], st["in_flight"]


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def _requests(c: Client, outcome: str, reason: str) -> int:
    [fam] = [f for f in c.metrics() if f["name"] == "requests"]
    return sum(s["value"] for s in fam["samples"] if s["labels"] == {"outcome": outcome, "reason": reason})


# -- models -------------------------------------------------------------------------------------------------


def test_models(oai, hmad):
    [model] = oai.models.list().data
    assert (model.id, model.object, model.owned_by) == (TINY_NAME, "model", "hmad")
    assert abs(model.created - time.time()) < 600  # when hmad started
    assert oai.models.retrieve(TINY_NAME).id == TINY_NAME
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


# -- chat ---------------------------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "b"}]},
]
HMAD_MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "x\nb"}]


def test_chat_equals_hmad(oai, hmad):
    r = oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=6, temperature=0)
    with Client(hmad.socket) as c:
        ref = c.generate(messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    [choice] = r.choices
    assert (choice.message.role, choice.message.content) == ("assistant", ref.text)
    assert choice.finish_reason == ref.finish_reason
    assert (r.object, r.model) == ("chat.completion", TINY_NAME) and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, ref.generated_tokens)
    assert r.usage.total_tokens == ref.prompt_tokens + ref.generated_tokens


def test_chat_stream(oai, hmad):
    chunks = list(
        oai.chat.completions.create(
            model="any",
            messages=MESSAGES,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with Client(hmad.socket) as c:
        ref = c.generate(messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.generated_tokens
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


# -- completions --------------------------------------------------------------------------------------------


def test_completions_raw_and_length(oai, hmad):
    r = oai.completions.create(model="any", prompt="x b", max_tokens=4, temperature=0)
    with Client(hmad.socket) as c:
        ref = c.generate("x b", raw=True, max_tokens=4, temperature=0)
    assert r.choices[0].text == ref.text == " b b b b"  # the raw prompt, no chat template
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, 4)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    again = oai.completions.create(model="any", prompt=["x b"], max_tokens=4, temperature=0)
    assert again.choices[0].text == ref.text


def test_completions_stream(oai, hmad):
    chunks = list(
        oai.completions.create(
            model="any",
            prompt="x b",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(p.text for p in pieces) == " b b b b b"
    assert [p.finish_reason for p in pieces][-1] == "length"
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_stop(oai, hmad, stream):
    kw = {"model": "any", "prompt": "x b", "max_tokens": 9, "temperature": 0, "stop": "b b"}
    if stream:
        pieces = [ch.choices[0] for ch in oai.completions.create(**kw, stream=True) if ch.choices]
        text, reason = "".join(p.text for p in pieces), pieces[-1].finish_reason
    else:
        choice = oai.completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == (" ", "stop")  # cut before the stop string
    r = oai.completions.create(**{**kw, "stop": ["zz", " b b b"]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("", "stop")


def test_cached_tokens_reported_where_hmad_has_a_prefix_cache(oai, hmad):
    prompt = " ".join(f"w{i}" for i in range(60)) + " x b"  # several KV blocks of 16 tokens
    first = oai.completions.create(model="any", prompt=prompt, max_tokens=2, temperature=0).usage
    second = oai.completions.create(model="any", prompt=prompt, max_tokens=2, temperature=0).usage
    if second.prompt_tokens_details is None:
        pytest.skip("this hmad reports no cached_tokens in done (no prefix cache)")
    assert first.prompt_tokens == second.prompt_tokens
    assert 16 <= second.prompt_tokens_details.cached_tokens < second.prompt_tokens  # whole blocks reused


def test_seed_reproducible(oai, hmad):
    kw = {"max_tokens": 12, "temperature": 1.5, "top_p": 0.95}
    texts = [oai.completions.create(model="any", prompt="a x b", seed=11, **kw).choices[0].text for _ in "12"]
    with Client(hmad.socket) as c:
        ref = c.generate("a x b", raw=True, seed=11, **kw)
        other = c.generate("a x b", raw=True, seed=12, **kw)
    assert texts == [ref.text, ref.text]
    assert oai.completions.create(model="any", prompt="a x b", seed=12, **kw).choices[0].text == other.text


# -- authentication and errors ----------------------------------------------------------------------------


def test_bearer_token(gateway, hmad):
    for key in ("wrong", ""):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key or "x", max_retries=0)
        if not key:
            client = client.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=1)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    r = httpx.get(gateway.url + "/metrics")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}  # open: for health checks


def test_cors_for_the_given_origin_only(gateway, http, hmad):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(gateway.url + "/v1/chat/completions", headers={"Origin": WEB_ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == WEB_ORIGIN  # no key needed
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(
        gateway.url + "/v1/chat/completions", headers={"Origin": "http://evil.test", **preflight}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = http.get("/v1/models", headers={"Origin": WEB_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == WEB_ORIGIN
    assert httpx.get(gateway.url + "/v1/models", headers={"Origin": WEB_ORIGIN}).status_code == 401  # still


CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat", {"n": 17}, "n"),
        ("chat", {"temperature": -1}, "temperature"),
        ("chat", {"temperature": "hot"}, "temperature"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"seed": -5}, "seed"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"logit_bias": {"1": 101}}, "logit_bias"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ("chat", {"stop": ["s"] * 17}, "stop"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
    ],
)
def test_bad_params_are_400(http, hmad, path, body, param):
    base = CHAT if path == "chat" else {"model": "any", "max_tokens": 2}
    r = http.post(f"/v1/{path}" if path == "completions" else "/v1/chat/completions", json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err


def test_malformed_bodies_and_too_long_prompt(http, oai, hmad):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=[1]).status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt="x " * 5000, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "context" in info.value.body["message"]


def test_busy_is_429(oai, hmad):
    """Three long generations fill the daemon (2 running + 1 queued): the next request is refused."""
    with Client(hmad.socket) as c:
        streams = [c.stream("x b", raw=True, max_tokens=100000) for _ in range(2)]
        for s in streams:
            next(s)  # running

        def queued():
            with contextlib.suppress(RequestCancelled):
                c.generate("x b", raw=True, max_tokens=100000, id="queued")

        waiting = threading.Thread(target=queued)
        waiting.start()
        _wait(lambda: _load(c) == (2, 1, 3))
        with pytest.raises(openai.RateLimitError) as info:
            oai.completions.create(model="any", prompt="x b", max_tokens=2)
        assert info.value.body["code"] == "busy"
        with pytest.raises(openai.RateLimitError):  # a stream is refused before it starts
            oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2, stream=True)
        c.cancel("queued")
        waiting.join(10)
        for s in streams:
            s.close()  # cancels it


@pytest.mark.skipif(HAS_JSON_SCHEMA, reason="hmaclient.protocol has generate's json_schema field")
def test_response_format_without_structured_output_is_400(oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="any", messages=MESSAGES, max_tokens=4, response_format={"type": "json_object"}
        )
    assert info.value.body["param"] == "response_format" and "json_schema" in info.value.body["message"]


@pytest.mark.skipif(not HAS_JSON_SCHEMA, reason="hmaclient.protocol has no json_schema field in generate yet")
def test_response_format_json_schema(oai, hmad):
    """A schema with finitely many compact answers (the tiny model would repeat a digit, a letter or a space
    for ever where the schema lets it): the answer completes, parses and satisfies it."""
    schema = {
        "type": "object",
        "properties": {"x": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # compact: no runs of blank space either
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=64, response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"x", "ok"} and value["x"] in (1, 2, 3) and isinstance(value["ok"], bool)


@pytest.mark.skipif(not HAS_JSON_SCHEMA, reason="hmaclient.protocol has no json_schema field in generate yet")
def test_response_format_json_object_is_hmads_object_schema(oai, hmad):
    fmt = {"type": "json_object"}
    r = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=12, temperature=0, response_format=fmt
    )
    with Client(hmad.socket) as c:
        ref = c.generate(messages=HMAD_MESSAGES, max_tokens=12, temperature=0, json_schema={"type": "object"})
    assert r.choices[0].message.content == ref.text and ref.text.startswith("{")


# -- disconnects ----------------------------------------------------------------------------------------


def test_disconnect_mid_stream_cancels_in_hmad(http, hmad):
    with Client(hmad.socket) as c:
        before = _requests(c, "cancelled", "cancel")
        body = {"model": "any", "prompt": "x b", "max_tokens": 100000, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            # one iterator kept open: leaving a loop over r.iter_lines() closes its generator, and with it
            # the connection (httpcore closes an unfinished stream), which would cancel before the check
            lines, events = r.iter_lines(), 0
            while events < 3:
                events += next(lines).startswith("data: ")
            assert _load(c)[0] == 1  # generating
        # the connection is closed: the gateway cancels the generation
        _wait(lambda: _load(c) == (0, 0, 0))
        assert _requests(c, "cancelled", "cancel") == before + 1


def test_disconnect_while_waiting_cancels_in_hmad(gateway, hmad):
    with Client(hmad.socket) as c:
        before = _requests(c, "cancelled", "cancel")
        body = {"model": "any", "prompt": "x b", "max_tokens": 100000}
        headers = {"Authorization": f"Bearer {KEY}"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=1.0)
        _wait(lambda: _load(c) == (0, 0, 0))
        assert _requests(c, "cancelled", "cancel") == before + 1


# -- metrics --------------------------------------------------------------------------------------------


def _scrape(http) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def test_metrics_endpoint_counts(http, oai, hmad):
    done = ("hmad_requests_total", (("outcome", "done"), ("reason", "length")))
    ttft = ("hmad_time_to_first_token_seconds_count", ())
    generated = ("hmad_generated_tokens_total", ())
    served = ("hmad_openai_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    m0 = _scrape(http)
    oai.completions.create(model="any", prompt="x b", max_tokens=3, temperature=0)
    m1 = _scrape(http)
    assert m1[done] == m0.get(done, 0) + 1
    assert m1[ttft] == m0.get(ttft, 0) + 1
    assert m1[generated] == m0[generated] + 3
    assert m1[served] == m0.get(served, 0) + 1
    assert m1[("hmad_up", ())] == 1
    assert m1[("hmad_kv_blocks", (("pool", "global"), ("state", "total")))] > 0
    assert m1[("hmad_kv_blocks", (("pool", "global"), ("state", "used")))] == 0  # all released
    assert any(name == "hmad_memory_bytes" and v > 0 for (name, _), v in m1.items())
    assert m1[("hmad_running", ())] == 0
    assert m1[("hmad_batch_size_count", ())] > m0[("hmad_batch_size_count", ())]


def test_unreachable_hmad_is_503(tmp_path):
    g = Gateway(str(tmp_path / "none.sock"), tmp_path)
    try:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "hmad_unreachable"
        assert "hmad is not running" in info.value.body["message"]
        assert httpx.get(g.url + "/health").status_code == 503
        text = httpx.get(g.url + "/metrics").text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["hmad_up"] == 0
    finally:
        assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


def test_hmad_restart_is_503_then_served_again(tiny_path, tmp_path):
    """hmad stops (systemd restarting it, say): requests get 503 while it is away, and the same gateway
    serves again once hmad is back on the same socket."""
    d = Daemon(tiny_path, tmp_path).wait_ready()
    g = Gateway(d.socket, tmp_path)
    try:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = {"model": "any", "prompt": "x b", "max_tokens": 2, "temperature": 0}
        assert client.completions.create(**kw).choices[0].text == " b b"
        assert d.stop() == 0
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(**kw)
        assert info.value.status_code == 503
        d = Daemon(tiny_path, tmp_path).wait_ready()
        assert client.completions.create(**kw).choices[0].text == " b b"
    finally:
        assert g.stop() in CLEAN_EXIT, g.log_path.read_text()
        d.stop()


@pytest.mark.slow
def test_embedded_model_chat(embedded_model_path, tmp_path):
    """Gemma 3 270M's own chat template and tokenizer through the gateway: the answer, streamed or whole,
    is hmad's (multi-byte pieces and all)."""
    d = Daemon(embedded_model_path, tmp_path, "engine.max_seqs=2").wait_ready()
    g = Gateway(d.socket, tmp_path)
    try:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name three colours, in French."}]
        kw = {"model": "any", "messages": messages, "max_tokens": 10, "temperature": 0}
        whole = client.chat.completions.create(**kw)
        streamed = "".join(
            ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
        )
        with Client(d.socket) as c:
            ref = c.generate(messages=messages, max_tokens=10, temperature=0)
        assert whole.choices[0].message.content == streamed == ref.text and ref.text.strip()
        [model] = client.models.list().data
        assert whole.usage.prompt_tokens == ref.prompt_tokens and whole.model == model.id
    finally:
        assert g.stop() in CLEAN_EXIT, g.log_path.read_text()
        assert d.stop() == 0, d.log_text()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--port", "99999"], "a TCP port is 0..65535"),
        (["--port", "x"], "invalid tcp_port value"),
        (["--api-key-file", "/nonexistent/key"], "No such file"),
        (["--api-key", "a", "--api-key-file", "b"], "not allowed with"),
        (["--host", "192.0.2.1"], "hmad-openai:"),  # TEST-NET-1: no address of this machine
        (["--header-timeout", "0"], "a timeout is over 0 and at most 3600 seconds"),
    ],
)
def test_usage_errors_exit_2(argv, says):
    p = subprocess.run(
        [sys.executable, "-m", "hmad_openai", *argv], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and says in p.stderr, p.stderr
