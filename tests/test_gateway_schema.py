"""The gateway's request bodies take hmad's sampling fields from the one table (hmaclient.sampling)."""

from __future__ import annotations

import json

import pytest

from hmaclient import sampling
from hmad_openai.errors import OpenAIError
from hmad_openai.schema import ChatRequest, CompletionRequest, parse

OUT_OF_RANGE = {
    "max_tokens": 0,
    "temperature": 100.5,
    "top_k": -1,
    "top_p": 0,
    "min_p": 1.5,
    "repetition_penalty": 0,
    "repeat_last_n": sampling.MAX_TOKENS_LIMIT + 1,
    "seed": -1,
}


@pytest.mark.parametrize("name, value", OUT_OF_RANGE.items())
def test_a_sampling_field_out_of_range_is_a_400_in_the_wires_words(name, value):
    with pytest.raises(OpenAIError) as e:
        parse(CompletionRequest, json.dumps({"prompt": "x", name: value}).encode())
    assert e.value.status == 400 and e.value.param == name
    assert str(e.value.message) == sampling.problem(name, value)


def test_in_range_fields_pass_through_and_absent_ones_are_the_daemons_default():
    body = {"prompt": "x", "temperature": 100, "top_k": 64, "seed": 2**64 - 1, "max_tokens": 3}
    assert parse(CompletionRequest, json.dumps(body).encode()).params() == {
        "temperature": 100.0,
        "top_k": 64,
        "seed": 2**64 - 1,
        "max_tokens": 3,
    }
    assert parse(CompletionRequest, b'{"prompt": "x"}').params() == {}


def test_max_completion_tokens_has_max_tokens_range():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}
    with pytest.raises(OpenAIError) as e:
        parse(ChatRequest, json.dumps(body).encode())
    assert e.value.param == "max_completion_tokens" and "an integer from 1 to 1000000" in e.value.message
