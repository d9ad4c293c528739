"""The per-request ``speculate`` switch where users reach it (docs/speculation.md, "Per request"):
``hmactl query --no-speculate``, the gateway's ``speculate`` body field (OpenAI chat and completions,
Anthropic, Responses) and Ollama's ``options.speculate``.

One real hmad (cpu, deterministic, ``speculation.mode=lookup``) on a tiny random GGUF that repeats a raw
prompt's last token, so lookup drafts; a real gateway in front of it. Each request switched off gives the
answer it gives switched on, and the daemon's drafted-token count (status ``speculation.drafted``) does not
grow for it, while the same request left to the default drafts.
"""

from __future__ import annotations

import gateway_harness as harness
import httpx
import ollama
import openai
import pytest
from daemon_harness import Daemon
from gateway_harness import KEY, TINY_NAME, Gateway
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, cli

PROMPT = "a b c a b c a b c a b"
TOKENS = 16
GREEDY_FLAGS = ["--temperature", "0", "--max-tokens", str(TOKENS)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)
    tmp = tmp_path_factory.mktemp("hmad")
    d = Daemon(path, tmp, "engine.deterministic=true", "speculation.mode=lookup", backend="cpu")
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


gateway = harness.gateway  # the gateway harness's, in front of this module's daemon


def drafted(daemon: Daemon) -> int:
    with Client(daemon.socket, timeout=30) as c:
        return c.status()["speculation"]["drafted"]


def off_then_on(daemon: Daemon, ask) -> tuple[str, str]:
    """``ask(speculate)`` (False, then None: the default): both answers, after checking that only the
    default one drafted."""
    before = drafted(daemon)
    off = ask(False)
    assert drafted(daemon) == before, "drafted with speculate off"
    on = ask(None)
    assert drafted(daemon) > before, "the default did not draft: the check above proves nothing"
    return off, on


def test_hmactl_no_speculate(daemon, capsys):
    def ask(speculate: bool | None) -> str:
        flag = ["--no-speculate"] if speculate is False else []
        argv = ["--socket", daemon.socket, "query", "--raw", *GREEDY_FLAGS]
        capsys.readouterr()
        assert cli.main([*argv, *flag, PROMPT]) == cli.EXIT_OK
        return capsys.readouterr().out

    off, on = off_then_on(daemon, ask)
    assert off == on and off.strip()
    assert cli.build_parser().parse_args(["query", "--speculate", "x"]).speculate is True
    assert cli.build_parser().parse_args(["query", "x"]).speculate is None  # not sent: the daemon's default


def openai_client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_completions_and_chat(daemon, gateway):
    oai = openai_client(gateway)

    def completion(speculate: bool | None) -> str:
        extra = {} if speculate is None else {"speculate": speculate}
        r = oai.completions.create(
            model="any", prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body=extra
        )
        return r.choices[0].text

    def chat(speculate: bool | None) -> str:
        extra = {} if speculate is None else {"speculate": speculate}
        messages = [{"role": "user", "content": PROMPT}]
        r = oai.chat.completions.create(
            model="any", messages=messages, max_tokens=TOKENS, temperature=0, extra_body=extra
        )
        return r.choices[0].message.content

    off, on = off_then_on(daemon, completion)
    assert off == on and off
    with Client(daemon.socket, timeout=30) as c:
        assert c.generate(PROMPT, raw=True, max_tokens=TOKENS, temperature=0.0).text == off
    off, on = off_then_on(daemon, chat)
    assert off == on


def test_ollama_options_speculate(daemon, gateway):
    client = ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def generate(speculate: bool | None) -> str:
        options = {"temperature": 0, "num_predict": TOKENS}
        if speculate is not None:
            options["speculate"] = speculate
        return client.generate(model=TINY_NAME, prompt=PROMPT, raw=True, options=options).response

    off, on = off_then_on(daemon, generate)
    assert off == on and off


ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": PROMPT}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}]}),
    "responses": ("/v1/responses", {"input": PROMPT}),
}


def post(gateway: Gateway, endpoint: str, **fields) -> httpx.Response:
    path, body = ENDPOINTS[endpoint]
    body = {"model": "any", "max_tokens": TOKENS, "temperature": 0, **body, **fields}
    if endpoint == "responses":
        body["max_output_tokens"] = body.pop("max_tokens")
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("endpoint", ["anthropic", "responses"])
def test_other_apis_take_speculate(daemon, gateway, endpoint):
    before = drafted(daemon)
    r = post(gateway, endpoint, speculate=False)
    assert r.status_code == 200, r.text
    assert drafted(daemon) == before
    r = post(gateway, endpoint, speculate=True)
    assert r.status_code == 200, r.text
    assert drafted(daemon) > before


@pytest.mark.parametrize("value", ["false", 0, 1, None])
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_non_bool_is_a_400(daemon, gateway, endpoint, value):
    """A non-bool refused with a 400 naming the field; null is the daemon's default."""
    r = post(gateway, endpoint, speculate=value)
    if value is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert "speculate must be true or false" in r.text, r.text


def test_a_non_bool_is_a_400_through_the_clients(daemon, gateway):
    with pytest.raises(openai.BadRequestError, match="speculate must be true or false") as info:
        openai_client(gateway).completions.create(
            model="any", prompt=PROMPT, max_tokens=TOKENS, extra_body={"speculate": "no"}
        )
    assert info.value.body["param"] == "speculate"
    client = ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    with pytest.raises(ollama.ResponseError, match="options.speculate must be true or false") as err:
        client.generate(model=TINY_NAME, prompt=PROMPT, raw=True, options={"speculate": 1})
    assert err.value.status_code == 400
