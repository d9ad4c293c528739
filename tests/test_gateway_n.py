"""OpenAI's ``n`` (several choices per request) through hmad-openai, with the official ``openai`` client
against a real gateway in front of a real hmad on a tiny random GGUF: each choice equals what hmaclient
gets for the same request (with a seed, choice i draws with seed + i), streamed choices reassemble by index
to the whole answer's, usage counts the prompt once, the siblings' prompt comes from hmad's prefix cache,
and a refusal or a client leaving cancels every sibling in hmad.

hmad runs 2 sequences and queues 3 (at most 5 generations in flight): n=3 runs 2 choices and queues one;
with both sequences taken, n=4 is refused busy.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from daemon_harness import Daemon
from gateway_harness import CLEAN_EXIT, KEY, Gateway, assert_serving, load, wait
from test_tool_calls_gateway import WEATHER, _valid_call
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

PROMPT = "a x b"
MESSAGES = [{"role": "user", "content": PROMPT}]
# near-uniform draws over the tiny vocabulary: seeds give different answers
HOT = {"temperature": 100.0, "top_p": 1.0, "extra_body": {"top_k": 0}}
HOT_HMAD = {"temperature": 100.0, "top_p": 1.0, "top_k": 0}
LONG = " ".join(f"w{i}" for i in range(60)) + " x b"  # several KV blocks of 16 tokens
NO_END = {"1": -100, "5": -100}  # the tiny vocabulary's <eos> and <end_of_turn> (tiny_gguf.SPECIAL) banned


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)
    d = Daemon(path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2", "engine.max_queue=3",
               "engine.deterministic=true")  # batched choices draw as hmaclient's one by one  # fmt: skip
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    g = Gateway(daemon.socket, tmp, "--api-key", KEY)
    yield g
    assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


@pytest.fixture
def hmad(daemon, gateway):
    yield daemon
    assert_serving(daemon, gateway)


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _refs(socket: str, n: int, seed: int | None = None, **kw) -> list:
    with Client(socket) as c:
        return [c.generate(**kw, **({} if seed is None else {"seed": seed + i})) for i in range(n)]


def _requests(c: Client, outcome: str, reason: str) -> int:
    [fam] = [f for f in c.metrics() if f["name"] == "requests"]
    return sum(s["value"] for s in fam["samples"] if s["labels"] == {"outcome": outcome, "reason": reason})


def _create(oai, chat: bool, **kw):
    """A chat completion of MESSAGES or a completion of PROMPT."""
    if chat:
        return oai.chat.completions.create(model="any", messages=MESSAGES, **kw)
    return oai.completions.create(model="any", prompt=PROMPT, **kw)


def _texts(r, chat: bool) -> list[str]:
    return [c.message.content if chat else c.text for c in r.choices]


@pytest.mark.parametrize("chat", [False, True])
def test_seeded_choices_differ_repeat_and_equal_hmads(oai, hmad, chat):
    inputs = {"messages": MESSAGES} if chat else {"prompt": PROMPT, "raw": True}
    refs = _refs(hmad.socket, 3, seed=7, max_tokens=6, **inputs, **HOT_HMAD)
    r = _create(oai, chat, n=3, seed=7, max_tokens=6, **HOT)
    again = _create(oai, chat, n=3, seed=7, max_tokens=6, **HOT)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert _texts(r, chat) == [ref.text for ref in refs] == _texts(again, chat)
    assert len(set(_texts(r, chat))) == 3  # seed, seed + 1, seed + 2
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    u = r.usage
    assert u.prompt_tokens == refs[0].prompt_tokens  # counted once
    assert u.completion_tokens == sum(ref.generated_tokens for ref in refs) == 18
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_greedy_choices_are_identical_and_unseeded_ones_differ(oai, hmad):
    [ref] = _refs(hmad.socket, 1, prompt=PROMPT, raw=True, max_tokens=5, temperature=0)
    greedy = oai.completions.create(model="any", prompt=PROMPT, n=3, max_tokens=5, temperature=0)
    assert [c.text for c in greedy.choices] == [ref.text] * 3
    hot = oai.completions.create(model="any", prompt=PROMPT, n=3, max_tokens=8, **HOT)
    assert len({c.text for c in hot.choices}) == 3  # fresh entropy each


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_reassemble_by_index(oai, hmad, chat):
    kw = {"n": 3, "seed": 21, "max_tokens": 6, **HOT}
    whole = _texts(_create(oai, chat, **kw), chat)
    chunks = list(_create(oai, chat, stream=True, stream_options={"include_usage": True}, **kw))
    texts, finishes, roles = ["", "", ""], [[], [], []], [0, 0, 0]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices  # one choice per chunk
        piece = (choice.delta.content if chat else choice.text) or ""
        texts[choice.index] += piece
        if chat and choice.delta.role == "assistant":
            roles[choice.index] += 1
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == whole and len(set(texts)) == 3
    assert finishes == [["length"]] * 3
    assert roles == ([1, 1, 1] if chat else [0, 0, 0])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 18
    assert last.usage.total_tokens == last.usage.prompt_tokens + 18


def test_siblings_share_the_prompt_through_the_prefix_cache(oai, hmad):
    with Client(hmad.socket) as c:
        before = c.status()["kv"]["prefix_cache"]
        if not before["enabled"]:
            pytest.skip("this hmad has no prefix cache")
        r = oai.completions.create(model="any", prompt=LONG + " one", n=3, max_tokens=2, temperature=0)
        after = c.status()["kv"]["prefix_cache"]
    assert len(r.choices) == 3 and r.usage.prompt_tokens > 48
    assert after["lookups"] - before["lookups"] == 3
    assert after["hits"] - before["hits"] >= 1  # the queued third at least: the first's blocks are its own
    assert after["reused_tokens"] - before["reused_tokens"] >= 48


def test_each_choice_may_be_tool_calls(oai, hmad):
    kw = {"model": "any", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "n": 2,
          "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}  # fmt: skip
    r = oai.chat.completions.create(**kw)
    assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 2
    args = [_valid_call(c.message.tool_calls[0]) for c in r.choices]
    assert args[0] == args[1]  # greedy
    calls: dict[int, list] = {0: [], 1: []}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        [choice] = chunk.choices
        assert not choice.delta.content
        calls[choice.index] += choice.delta.tool_calls or []
    assert [json.loads(calls[i][0].function.arguments) for i in (0, 1)] == args


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"n": 17}, "n", "n must be an integer from 1 to 16 (choices per request), got 17"),
        ({"n": 0}, "n", "n must be an integer from 1 to 16"),
        ({"n": 2.5}, "n", "n: "),
        ({"n": 2, "best_of": 3}, "best_of", "best_of must be 1, got 3"),
    ],
)
def test_bad_n_is_400(oai, hmad, body, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt=PROMPT, max_tokens=2, extra_body=body)
    assert info.value.body["message"].startswith(says) and info.value.body["param"] == param
    if "best_of" not in body:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2, extra_body=body)
        assert info.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_choice_cancels_its_siblings(oai, hmad, stream):
    """Both sequences taken by two long generations (end tokens banned: they cannot end meanwhile), n=4
    is past what hmad takes in flight: three choices queue and the fourth is refused busy (429) before
    any answer starts, and the three are cancelled (the ``hmad`` fixture checks nothing still runs).
    With the sequences free, the engine could refuse a queued choice itself after hmad accepted it
    (its queue holds 3 while the running ones are still taken in), and a stream would already be 200."""
    with Client(hmad.socket) as c, Client(hmad.socket) as holder:
        before = _requests(c, "error", "busy")
        held = [holder.stream("x b", max_tokens=100000, logit_bias={1: -100, 5: -100}) for _ in range(2)]
        for g in held:
            next(g)  # its first piece: it runs
        wait(lambda: load(c) == (2, 0, 2))
        with pytest.raises(openai.RateLimitError) as info:
            oai.completions.create(
                model="any", prompt="x b", n=4, max_tokens=100000, stream=stream, logit_bias=NO_END
            )
        assert info.value.body["code"] == "busy"
        wait(lambda: load(c) == (2, 0, 2))  # the three queued choices cancelled, the two held still run
        holder.close()  # cancels the held generations
        wait(lambda: load(c) == (0, 0, 0))
        assert _requests(c, "error", "busy") > before


def test_a_client_leaving_a_stream_cancels_every_choice(gateway, hmad):
    body = {"model": "any", "prompt": "x b", "n": 3, "max_tokens": 100000, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with Client(hmad.socket) as c, httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        before = _requests(c, "cancelled", "cancel")
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines, indexes = r.iter_lines(), set()
            while len(indexes) < 2:  # both running choices have sent pieces
                line = next(lines)
                if line.startswith("data: {"):
                    indexes.add(line.split('"index":')[1][0])
            # the third choice is in flight from its arrival, queued once the engine's next turn takes it
            wait(lambda: load(c) == (2, 1, 3))
        wait(lambda: load(c) == (0, 0, 0))
        assert _requests(c, "cancelled", "cancel") == before + 3


def test_a_client_leaving_a_whole_answer_cancels_every_choice(gateway, hmad):
    body = {"model": "any", "prompt": "x b", "n": 3, "max_tokens": 100000}
    headers = {"Authorization": f"Bearer {KEY}"}
    with Client(hmad.socket) as c:
        before = _requests(c, "cancelled", "cancel")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=1.0)
        wait(lambda: load(c) == (0, 0, 0))
        assert _requests(c, "cancelled", "cancel") == before + 3
