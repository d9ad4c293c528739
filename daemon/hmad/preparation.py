"""A generate request's preparation, run on the intake thread (hmad/intake.py), and what its failure answers.

``prepare`` turns the request into what the engine takes: its sampling parameters (the defaults under the
request's own, checked), its json_schema's grammar or its tools' call grammar (compiled, and checked
against this model's vocabulary so it fails here rather than mid-request), and its prompt ids (chat
template or raw prompt, with the tools written in by hmad.model.tools, tokenized, checked against the
context). ``refusal`` names the reply a failure of it gets.
"""

from __future__ import annotations

import collections
import logging

from hmaclient import protocol as P
from hmad.core.errors import UnencodableText
from hmad.engine.sampling import SamplingParams
from hmad.engine.structured import check_schema, compile_schema
from hmad.engine.tool_calls import ToolGrammar, check_tools, tool_grammar
from hmad.model.chat import render_chat, render_prompt
from hmad.model.tools import fold_tools

log = logging.getLogger("hmad.server")


class PromptTooLong(ValueError):
    """The prompt cannot fit the context (answered ``prompt_too_long``)."""


def prepare(
    req, defaults: SamplingParams, model, context: int
) -> tuple[list[int], SamplingParams, str | ToolGrammar | None]:
    """Prompt ids, sampling parameters and the grammar (json_schema's, or the tools'); raises
    PromptTooLong, UnencodableText or ValueError (naming the problem)."""
    params = SamplingParams(**{**vars(defaults), **req.sampling()})
    params.validate()
    params.check_vocab(model.config.vocab_size)  # a logit_bias id past the vocabulary: bad_request
    grammar = _grammar(req, model.tokenizer)
    template = model.tokenizer.chat_template  # the model's own, or None: the built-in Gemma turns
    messages = req.messages
    if messages is None and req.tools and not req.raw:  # (a raw prompt's tool_choice is "none")
        messages = [{"role": "user", "content": req.prompt}]
    if messages is not None:  # tools and tool turns as plain turns
        messages = fold_tools(messages, req.tools, req.tool_choice)
        text = render_chat(messages, template=template)
    else:
        text = req.prompt if req.raw else render_prompt(req.prompt, template)
    tok = model.tokenizer
    if tok.max_token_chars and len(text) > tok.max_token_chars * context:  # surely too long: skip
        raise PromptTooLong(  # tokenizing it (seconds for a MAX_PROMPT_CHARS prompt)
            f"the prompt of {len(text)} characters is at least {-(-len(text) // tok.max_token_chars)} "
            f"tokens; the context holds {context}"
        )
    ids = tok.encode(text)
    if len(ids) >= context:
        raise PromptTooLong(f"the prompt is {len(ids)} tokens; the context holds {context}")
    return ids, params, grammar


def _grammar(req, tokenizer) -> str | ToolGrammar | None:
    """The json_schema's or the tools' grammar, checked against this model's vocabulary (so it fails
    here, not mid-request); None when the answer is free."""
    if req.json_schema is not None:
        grammar = compile_schema(req.json_schema)
        check_schema(grammar, tokenizer)
        return grammar
    if req.calls_tools:
        grammar = tool_grammar(req.tools, req.tool_choice, req.parallel_tool_calls)
        check_tools(grammar, tokenizer)
        return grammar
    return None


def refusal(e: BaseException, counters: collections.Counter) -> tuple[str, str]:
    """The (code, message) a request whose preparation raised ``e`` is refused with."""
    if isinstance(e, PromptTooLong):
        return P.PROMPT_TOO_LONG, str(e)
    if isinstance(e, UnencodableText):
        counters["unencodable"] += 1
        return P.BAD_REQUEST, str(e)
    if isinstance(e, ValueError):  # the chat template's, SamplingParams' or the schema's checks
        return P.BAD_REQUEST, str(e)
    log.error("preparing a request failed", exc_info=e)
    counters["internal"] += 1
    return P.INTERNAL, f"hmad failed on this request: {type(e).__name__}: {e}"
