"""Images in a prompt, as Gemma 3's processor (transformers' Gemma3Processor) puts them.

A message's content may be a list of parts, ``{"type": "text", "text"}`` and ``{"type": "image"}``
(the wire's image bytes are taken out first: ``take_images``). The chat template writes
``<start_of_image>`` for each image part (Gemma 3's own template does; so does the built-in format,
model/chat.py). Then, as the processor does, each of those markers becomes

    \\n\\n<start_of_image>[soft token x mm_tokens_per_image]<end_of_image>\\n\\n

the newlines part of the text around them (``expand_markers``, before tokenizing), and the soft tokens
are inserted after tokenizing (``insert_soft_tokens``): placeholder ids whose input embeddings the vision
tower gives (engine/images.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hmad.model.tokenizer import TemplateText, Tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


def take_images(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages with every image part's bytes taken out (parts become ``{"type": "image"}``), and the
    bytes in order; a list of text parts alone becomes its text (joined)."""
    out, found = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    found.append(p["image"])
                    p = {"type": "image"}
                parts.append(p)
            has_image = any(p["type"] == "image" for p in parts)
            m = {**m, "content": parts if has_image else "".join(p["text"] for p in parts)}
        out.append(m)
    return out, found


def image_ids(tok: Tokenizer) -> tuple[int, int, int]:
    """(start-of-image, end-of-image, soft-token placeholder) ids of ``tok``; ValueError naming what the
    vocabulary lacks. The placeholder is ``<image_soft_token>`` where the vocabulary has it, else pad (0):
    its embedding is never read."""
    boi, eoi = tok.token_id(BOI), tok.token_id(EOI)
    if boi is None or eoi is None:
        raise ValueError(f"this model's vocabulary has no {BOI} / {EOI} tokens")
    soft = tok.token_id(SOFT)
    return boi, eoi, 0 if soft is None else soft


def expand_markers(text: TemplateText) -> TemplateText:
    """Each ``<start_of_image>`` as ``\\n\\n<start_of_image><end_of_image>\\n\\n`` (the soft tokens go between
    the two once tokenized), as the processor replaces every occurrence in the text. A template's marker
    stays a marker; in plain text (a vocabulary where ``<start_of_image>`` is a user-defined token, which
    the tokenizer matches anywhere, as llama.cpp does: Gemma 3's GGUFs) it stays plain text."""
    pieces: list[tuple[str, bool]] = []
    for piece, marker in text.segments():
        for k, part in enumerate(piece.split(BOI)):
            if k:
                pieces += [("\n\n", False), (BOI, marker), (EOI, marker), ("\n\n", False)]
            if part:
                pieces.append((part, marker))
    return TemplateText(pieces)


def insert_soft_tokens(ids: list[int], tok: Tokenizer, n: int, n_images: int) -> tuple[list[int], list[int]]:
    """``ids`` with ``n`` placeholders after each start-of-image id, and the position of each image's first
    soft token. ValueError when the prompt's image markers are not one per image."""
    boi, eoi, soft = image_ids(tok)
    out, starts = [], []
    for i, t in enumerate(ids):
        out.append(t)
        if t == boi:
            if i + 1 >= len(ids) or ids[i + 1] != eoi:
                raise ValueError(f"the chat template wrote {BOI} without {EOI} after it")
            starts.append(len(out))
            out += [soft] * n
    if len(starts) != n_images:
        raise ValueError(
            f"the chat template placed {len(starts)} image markers for {n_images} images "
            "(a template that drops image parts cannot take images)"
        )
    return out, starts
