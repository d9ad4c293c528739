"""The gateway's request bodies take hmad's sampling fields from the one table (hmaclient.sampling)."""

from __future__ import annotations

import json

import pytest

from hmaclient import sampling
from hmad_openai.errors import OpenAIError
from hmad_openai.openai_api import CallText
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


def test_tools_and_tool_turns_pass_to_hmad_and_legacy_functions_are_refused():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    req = parse(ChatRequest, json.dumps(body).encode())
    assert req.params() == {"tools": body["tools"], "tool_choice": "required", "parallel_tool_calls": False}
    assert req.calls_tools and req.must_call
    assert req.hmad_messages()[2:] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    for legacy in ({"functions": [{"name": "f"}]}, {"function_call": "auto"}):
        with pytest.raises(OpenAIError, match="send tools and tool_choice"):
            parse(ChatRequest, json.dumps({**body, **legacy}).encode()).params()
    body["messages"][3].pop("tool_call_id")
    with pytest.raises(OpenAIError) as e:
        parse(ChatRequest, json.dumps(body).encode()).hmad_messages()
    assert e.value.param == "messages[3].tool_call_id"


@pytest.mark.parametrize(
    "tools, forced, pieces, sent, left",
    [
        (False, False, [" {", "x"], [" {", "x"], ""),  # no tools: all text
        (True, False, [" ", "\n", "Hi", "!"], ["", "", " \nHi", "!"], ""),  # spaces wait for the first char
        (True, False, [" ", '{"na', 'me"'], ["", "", ""], ' {"name"'),  # a call: held back, never content
        (True, True, ["Hi"], [""], "Hi"),  # required: whatever comes is the call's
    ],
)
def test_streamed_text_of_a_possible_call_is_held_back(tools, forced, pieces, sent, left):
    held = CallText(tools, forced)
    assert [held.feed(p) for p in pieces] == sent
    assert held.rest() == left
