"""A generate request's preparation, run on the intake thread (hmad/intake.py), and what its failure answers.

``prepare`` turns the request into what the engine takes: its sampling parameters (the defaults under the
request's own, checked), its json_schema's grammar or its tools' call grammar (compiled, and checked
against this model's vocabulary so it fails here rather than mid-request), and its prompt ids (chat
template or raw prompt, with the tools written in by hmad.model.tools, tokenized, checked against the
context). Images (image parts of a message, or ``images`` beside a prompt) are decoded and preprocessed here
(hmad.model.images), placed in the prompt as Gemma 3's processor places them (hmad.model.vision_prompt), and
go to the engine as spans of soft tokens (hmad.engine.images), encoded there. ``refusal`` names the reply a
failure of it gets.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from hmaclient import protocol as P
from hmad.core.errors import UnencodableText
from hmad.engine.images import ImageSpan
from hmad.engine.sampling import SamplingParams
from hmad.engine.structured import check_schema, compile_schema
from hmad.engine.tool_calls import ToolGrammar, check_tools, tool_grammar
from hmad.model.chat import render_chat, render_prompt
from hmad.model.images import ImageLimits, PreparedImage, check_count, prepare_image
from hmad.model.tools import fold_tools
from hmad.model.vision_prompt import expand_markers, insert_soft_tokens, take_images

log = logging.getLogger("hmad.server")


class PromptTooLong(ValueError):
    """The prompt cannot fit the context (answered ``prompt_too_long``)."""


class Unsupported(ValueError):
    """The loaded model cannot do what the request asks, e.g. images without a vision tower (answered
    ``unsupported``)."""


@dataclass
class Prepared:
    """What the engine takes: the prompt's ids, the sampling parameters, the grammar, the images' spans."""

    ids: list[int]
    params: SamplingParams
    grammar: str | ToolGrammar | None
    images: list[ImageSpan] = field(default_factory=list)
    speculate: bool = True  # the request's ``speculate`` (engine/speculation)


def prepare(
    req, defaults: SamplingParams, model, context: int, limits: ImageLimits | None = None
) -> Prepared:
    """The request prepared for the engine; raises PromptTooLong, Unsupported, UnencodableText or
    ValueError (naming the problem: a bad image is one)."""
    params = SamplingParams(**{**vars(defaults), **req.sampling()})
    params.validate()
    params.check_vocab(model.config.vocab_size)  # a logit_bias id past the vocabulary: bad_request
    grammar = _grammar(req, model.tokenizer)
    template = model.tokenizer.chat_template  # the model's own, or None: the built-in Gemma turns
    messages, images = _messages(req), []
    if messages is not None:  # tools and tool turns as plain turns
        messages, data = take_images(messages)
        images = _images(data, model, context, limits or ImageLimits())
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
    ids, spans = _tokens(text, images, model)
    if len(ids) >= context:
        raise PromptTooLong(f"the prompt is {len(ids)} tokens; the context holds {context}")
    return Prepared(ids, params, grammar, spans, getattr(req, "speculate", True))


def _messages(req) -> list[dict] | None:
    """The request's turns: its messages; a prompt with images or tools as one user turn (its images
    first, as Ollama's generate puts them); None for a prompt rendered alone."""
    images = getattr(req, "images", None) or []
    if req.messages is not None:
        return req.messages
    if req.raw or not (images or req.tools):  # (a raw prompt's tool_choice is "none")
        return None
    if not images:
        return [{"role": "user", "content": req.prompt}]
    parts = [{"type": "image", "image": b} for b in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": req.prompt}]}]


def _images(data: list[bytes], model, context: int, limits: ImageLimits) -> list[PreparedImage]:
    """Each image decoded and preprocessed for the model's vision tower, in order."""
    if not data:
        return []
    vision = getattr(model, "vision", None)
    if vision is None:
        raise Unsupported(f"this model ({model.path}) has no vision tower: it cannot take images")
    check_count(len(data), limits)
    cfg = vision.cfg
    need = len(data) * (cfg.mm_tokens_per_image + 2)
    if need >= context:
        raise PromptTooLong(
            f"{len(data)} images take {need} tokens ({cfg.mm_tokens_per_image} + 2 each); "
            f"the context holds {context}"
        )
    return [
        prepare_image(d, cfg.image_size, cfg.image_mean, cfg.image_std, limits, index=i + 1)
        for i, d in enumerate(data)
    ]


def _tokens(text, images: list[PreparedImage], model) -> tuple[list[int], list[ImageSpan]]:
    """The prompt's ids, each image's soft tokens in its place, and their spans."""
    tok = model.tokenizer
    if not images:
        return tok.encode(text), []
    n = model.vision.cfg.mm_tokens_per_image
    ids, starts = insert_soft_tokens(tok.encode(expand_markers(text)), tok, n, len(images))
    return ids, [ImageSpan(st, n, im.digest, im.pixels) for st, im in zip(starts, images, strict=True)]


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
    if isinstance(e, Unsupported):
        return P.UNSUPPORTED, str(e)
    if isinstance(e, UnencodableText):
        counters["unencodable"] += 1
        return P.BAD_REQUEST, str(e)
    if isinstance(e, ValueError):  # the chat template's, SamplingParams' or the schema's checks
        return P.BAD_REQUEST, str(e)
    log.error("preparing a request failed", exc_info=e)
    counters["internal"] += 1
    return P.INTERNAL, f"hmad failed on this request: {type(e).__name__}: {e}"
