"""OpenAI's presence_penalty, frequency_penalty and logit_bias through hmad-openai, with the official
``openai`` client against a real gateway in front of a real hmad (gateway_harness.py): -100 bans the greedy
token, +100 makes greedy answer its token, zero penalties change nothing, and each answer equals
hmaclient's for the same fields; values out of range are 400s in the wire's words."""

from __future__ import annotations

import gateway_harness as harness
import openai
import pytest
from gateway_harness import KEY
from tiny_gguf import tiny_vocab

from hmaclient import Client

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures

VOCAB = tiny_vocab()[0]
PROMPT = "x b"  # the tiny model repeats the last token: greedy " b b b b"
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _ref(socket: str, **kw):
    with Client(socket) as c:
        return c.generate(**kw)


def test_logit_bias_minus_100_bans_the_greedy_token_plus_100_forces_one(oai, hmad):
    """The tiny model's top logit stands 50 to 100 above the runner-up: -100 on the greedy token gives the
    runner-up, and +100 on the runner-up alone makes greedy answer it."""
    plain = _ref(hmad.socket, prompt=PROMPT, raw=True, **GREEDY)
    top = plain.token_ids[0]
    banned = _ref(hmad.socket, prompt=PROMPT, raw=True, logit_bias={str(top): -100}, **GREEDY)
    assert top not in banned.token_ids and banned.text != plain.text
    got = oai.completions.create(model="any", prompt=PROMPT, logit_bias={str(top): -100}, **GREEDY)
    assert got.choices[0].text == banned.text
    second = banned.token_ids[0]
    forced = _ref(hmad.socket, prompt=PROMPT, raw=True, logit_bias={str(second): 100}, **GREEDY)
    assert forced.token_ids == [second] * 4
    bias = {str(second): 100}
    got = oai.completions.create(model="any", prompt=PROMPT, logit_bias=bias, **GREEDY)
    assert got.choices[0].text == forced.text
    streamed = oai.completions.create(model="any", prompt=PROMPT, logit_bias=bias, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == forced.text


def test_logit_bias_on_chat_equals_hmads(oai, hmad):
    top = _ref(hmad.socket, messages=MESSAGES, **GREEDY).token_ids[0]
    bias = {str(top): -100}
    ref = _ref(hmad.socket, messages=MESSAGES, logit_bias=bias, **GREEDY)
    assert top not in ref.token_ids
    chat = oai.chat.completions.create(model="any", messages=MESSAGES, logit_bias=bias, **GREEDY)
    assert chat.choices[0].message.content == ref.text


def test_zero_penalties_change_nothing_and_others_equal_hmads(oai, hmad):
    plain = oai.completions.create(model="any", prompt="a x b", **GREEDY).choices[0].text
    zero = oai.completions.create(  # what many frameworks send by default
        model="any", prompt="a x b", presence_penalty=0, frequency_penalty=0.0, logit_bias={}, n=1, **GREEDY
    ).choices[0]
    assert zero.text == plain
    kw = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "max_tokens": 8, "temperature": 0}
    ref = _ref(hmad.socket, prompt="a x b", raw=True, **kw)
    got = oai.completions.create(model="any", prompt="a x b", **kw).choices[0].text
    assert got == ref.text
    chat = oai.chat.completions.create(model="any", messages=MESSAGES, presence_penalty=-2, **GREEDY)
    assert chat.choices[0].message.content == _ref(hmad.socket, messages=MESSAGES, presence_penalty=-2,
                                                   **GREEDY).text  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2], got -3"),
        ({"logit_bias": {"5": 101}}, "logit_bias['5'] must be a number in [-100, 100], got 101"),
        ({"logit_bias": {"five": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": dict.fromkeys(map(str, range(301)), 1)}, "logit_bias has 301 entries, over the"),
    ],
)
def test_bad_values_are_400_in_the_wires_words(oai, hmad, fields, says):
    for create in (oai.chat.completions.create, oai.completions.create):
        inputs = {"messages": MESSAGES} if create == oai.chat.completions.create else {"prompt": PROMPT}
        with pytest.raises(openai.BadRequestError) as info:
            create(model="any", max_tokens=2, **inputs, **fields)
        body = info.value.body
        assert body["message"].startswith(says) and body["param"] == next(iter(fields)), body


def test_an_id_outside_the_vocabulary_is_400(oai, hmad):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt=PROMPT, max_tokens=2, logit_bias={str(len(VOCAB)): 5})
    assert "logit_bias" in info.value.body["message"], info.value.body
