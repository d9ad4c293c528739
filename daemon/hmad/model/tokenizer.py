"""Tokenizers: the interface, and llama.cpp's SPM vocab from GGUF metadata (HF's tokenizer.json:
hf_tokenizer.py).

``SpmTokenizer`` reproduces llama.cpp's ``llm_tokenizer_spm`` (src/llama-vocab.cpp) id for id; the test
fixture ``tests/fixtures/tokenizer_llamacpp.json`` is made by llama.cpp itself. The llama.cpp behaviour that
matters, in the order ``encode`` runs it:

1. Special-token partition (``tokenizer_st_partition``): the raw text is cut at every occurrence of a
   "special" token - attribute CONTROL, USER_DEFINED or UNKNOWN - taken one token at a time, longest text
   (in UTF-8 bytes) first, leftmost occurrences first. USER_DEFINED tokens are cut even when
   ``parse_special`` is false; CONTROL/UNKNOWN only when it is true. In Gemma 3 the USER_DEFINED tokens
   include runs of 2-31 plain spaces, runs of 1-31 ``\\n`` and ``\\t`` and some HTML tags, so those are
   always separate tokens. LSTRIP/RSTRIP attributes eat ASCII whitespace beside a match.
2. Each raw fragment: a space is prepended when ``add_space_prefix`` and the previous fragment was a
   token (or it is the first), then every ``" "`` becomes U+2581. No Unicode normalisation.
3. SPM merge: start from one symbol per code point; repeatedly merge the adjacent pair whose
   concatenation is in the vocabulary (ANY token type, control tokens included) with the highest score,
   ties to the leftmost pair.
4. Each final symbol that is a token is emitted; a symbol that is not (only single code points can be)
   is emitted as its UTF-8 bytes through the ``<0xXX>`` byte tokens. A vocabulary without a byte token
   for one of those bytes (no ``<0xXX>`` and, for ASCII, no one-character token) cannot encode the text:
   llama.cpp's ``byte_to_token`` throws ``std::out_of_range`` there (``token_to_id.at``; no fallback to
   UNK), and ``encode`` raises :class:`hmad.core.errors.UnencodableText` naming the character and the byte,
   which the daemon answers as that request's ``bad_request``.

Decoding follows ``token_to_piece``: NORMAL pieces get U+2581 turned back into spaces, USER_DEFINED
pieces are copied verbatim, BYTE tokens give their byte, CONTROL/UNKNOWN give nothing unless specials
are asked for, other types give nothing.
"""

from __future__ import annotations

import codecs
import heapq
from collections.abc import Iterable, Sequence
from enum import IntFlag
from typing import Any

import numpy as np

from hmad.core.errors import UnencodableText

SPACE_MARK = "\u2581"  # "▁", SentencePiece's escaped space
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used by LSTRIP/RSTRIP
#: items of a per-character list built or freed in one C call: the GIL can change hands between slices
GIL_SLICE = 1 << 16

# Token texts llama.cpp treats as end-of-turn / end-of-generation when the GGUF names none
# (llama_vocab::impl::load). It also forces the CONTROL attribute on them.
_EOT_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
)
_EOG_NAMES = _EOT_NAMES + ("<|eom_id|>", "<|return|>", "<|call|>")


class TokenAttr(IntFlag):
    """llama.cpp's ``llama_token_attr`` bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF tokenizer.ggml.token_type (llama_token_type) -> attribute; anything else is UNDEFINED.
_TYPE_TO_ATTR = {
    1: TokenAttr.NORMAL,
    2: TokenAttr.UNKNOWN,
    3: TokenAttr.CONTROL,
    4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED,
    6: TokenAttr.BYTE,
}
_HIDDEN = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # rendered only when specials are asked for


class TemplateText(str):
    """A prompt a chat template made: a ``str`` (what the server measures, logs and caches) that also knows
    which of its spans are the template's own control tokens.

    ``Tokenizer.encode`` parses only those spans as control tokens; everything else (message content, role
    names, newlines) is tokenized as plain text, so a message that says ``<end_of_turn>`` or
    ``<start_of_turn>model`` cannot end its turn or open another. Text without control-token text encodes to
    the same ids as before. Any ``str`` operation on it (slicing, ``+``, ``strip``) gives a plain ``str``,
    which is encoded as a raw prompt (control-token text parsed wherever it is).
    """

    markers: tuple[tuple[int, int], ...]  # (start, end) of each control-token span, in order

    def __new__(cls, pieces: Iterable[tuple[str, bool]]) -> TemplateText:
        """``pieces``: (text, is_control_token) in order."""
        texts, markers, pos = [], [], 0
        for text, marker in pieces:
            if marker:
                markers.append((pos, pos + len(text)))
            texts.append(text)
            pos += len(text)
        self = super().__new__(cls, "".join(texts))
        self.markers = tuple(markers)
        return self

    def __getnewargs__(self) -> tuple[tuple[tuple[str, bool], ...]]:  # pickling keeps the markers
        return (tuple(self.segments()),)

    def segments(self) -> list[tuple[str, bool]]:
        """(text, is_control_token) in order, the plain text between two markers as one piece."""
        out, pos, text = [], 0, str(self)
        for start, end in self.markers:
            if start > pos:
                out.append((text[pos:start], False))
            out.append((text[start:end], True))
            pos = end
        if pos < len(text):
            out.append((text[pos:], False))
        return out


class Tokenizer:
    """The interface every tokenizer offers to the engine, the chat formatter and the server.

    Subclasses set ``vocab_size``, ``bos_id``, ``eos_id``, ``eot_ids`` and implement ``encode``,
    ``token_bytes``, ``token_id`` and ``is_special``; decoding is shared and defined by ``token_bytes``.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]  # ids that end a turn / a generation (EOS, <end_of_turn>, ...)
    strip_first_space: bool = False  # drop one leading space of the first piece when decoding
    #: No token covers more than this many characters of the text, so ``encode(text)`` gives at least
    #: ``len(text) / max_token_chars`` ids (the server refuses a prompt that long without tokenizing it);
    #: None where no such bound holds (normalizers or stripping tokens may drop characters).
    max_token_chars: int | None = None
    #: The model file's own chat template (``hmad.model.chat_template.ChatTemplate``), or None: then the
    #: built-in Gemma turns (``hmad.model.chat``) format chats.
    chat_template: Any = None

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``parse_special`` lets control-token texts (``<start_of_turn>``) match.

        A :class:`TemplateText` (a chat template's prompt) with ``parse_special`` matches them only in the
        template's own markers (``encode_template``)."""
        raise NotImplementedError

    def encode_template(self, text: TemplateText, add_bos: bool = True) -> list[int]:
        """Ids of a chat template's prompt: its markers parsed as control tokens, the rest as plain text.

        Each plain run is what the whole-text partition would cut out between two markers, so text that
        holds no control-token text gets the ids a plain ``encode`` gives."""
        ids = self.encode("", add_bos=add_bos)  # the BOS this tokenizer adds, if any
        for piece, marker in text.segments():
            ids += self.encode(piece, add_bos=False, parse_special=marker)
        return ids

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """Bytes token ``token_id`` adds to the output; control tokens give b"" unless ``special``."""
        raise NotImplementedError

    def control_texts(self) -> list[str]:
        """The texts ``encode`` turns into control tokens only with ``parse_special`` (chat templates keep
        them out of message content)."""
        raise NotImplementedError

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary entry is exactly ``text``, or None."""
        raise NotImplementedError

    def is_special(self, token_id: int) -> bool:
        """True for control/unknown tokens: the ones ``decode(skip_special=True)`` leaves out."""
        raise NotImplementedError

    def strips_space(self, index: int, emitted: bool) -> bool:
        """Whether the piece of the ``index``-th token loses one leading space when decoding.

        ``emitted`` says whether earlier tokens produced any bytes. The default drops it from the first
        piece that has bytes (HF decoders: Metaspace, Strip after Fuse).
        """
        return self.strip_first_space and not emitted

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        """Concatenated raw bytes of ``ids`` (may end inside a UTF-8 character)."""
        parts: list[bytes] = []
        for index, tid in enumerate(ids):
            data = self.token_bytes(int(tid), not skip_special)
            if data[:1] == b" " and self.strips_space(index, bool(parts)):
                data = data[1:]
            if data:
                parts.append(data)
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. Equals llama.cpp's detokenize for SPM."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text pieces that are always whole UTF-8 characters.

    ``feed`` returns only completed characters and holds the bytes of a character split across tokens;
    ``flush`` returns what is left (an incomplete tail becomes U+FFFD). The concatenation of every piece
    equals ``tokenizer.decode(all_ids, skip_special)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._index = 0
        self._emitted = False

    def feed(self, token_id: int) -> str:
        data = self._tok.token_bytes(int(token_id), self._special)
        if data[:1] == b" " and self._tok.strips_space(self._index, self._emitted):
            data = data[1:]
        self._index += 1
        self._emitted = self._emitted or bool(data)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --------------------------------------------------------------------------------------------------
# llama.cpp SPM
# --------------------------------------------------------------------------------------------------


class SpmTokenizer(Tokenizer):
    """llama.cpp's SPM tokenizer ("llama" in ``tokenizer.ggml.model``), exact to its token ids."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float] | np.ndarray | None,
        token_types: Sequence[int] | np.ndarray | None,
        *,
        bos_id: int | None = 1,
        eos_id: int | None = 2,
        unk_id: int | None = 0,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool = True,
        add_space_prefix: bool = True,
        model_name: str = "",
    ):
        n = len(tokens)
        # llama.cpp renames empty entries so they stay unique and never match text.
        self._text = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._to_id = dict(zip(self._text, range(n), strict=True))
        if len(self._to_id) != n:
            raise ValueError("duplicate token in vocabulary")
        if scores is None:
            scores = np.zeros(n, np.float32)
        # float32 -> Python float is exact, so score comparisons are the same as in C++.
        self._scores: list[float] = np.asarray(scores, dtype=np.float32)[:n].tolist()
        self._attr = self._attrs_from_types(token_types, n)
        self.vocab_size = n
        self.bos_id, self.eos_id, self.unk_id = (_in_range(x, n) for x in (bos_id, eos_id, unk_id))
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.eot_ids = self._find_eog(_in_range(eot_id, n), _in_range(eom_id, n))
        self._apply_model_quirks(model_name)
        self._specials = self._special_groups()
        self._byte_ids = [self._lookup_byte(b) for b in range(256)]
        strips = bool((np.asarray(self._attr) & int(TokenAttr.LSTRIP | TokenAttr.RSTRIP)).any())
        self.max_token_chars = None if strips else max(map(len, self._text), default=1)

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> SpmTokenizer:
        """Build from GGUF metadata (``tokenizer.ggml.*`` keys as plain Python values or arrays).

        Defaults are llama.cpp's for an SPM vocab when a key is absent: BOS 1, EOS 2, UNK 0,
        ``add_bos_token`` true, ``add_space_prefix`` true.
        """
        model = meta.get("tokenizer.ggml.model", "llama")
        if model != "llama":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; SpmTokenizer handles 'llama'")
        k = "tokenizer.ggml."
        tokens = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in meta[k + "tokens"]]
        tok = cls(
            tokens,
            meta.get(k + "scores"),
            meta.get(k + "token_type"),
            bos_id=_opt_int(meta.get(k + "bos_token_id", 1)),
            eos_id=_opt_int(meta.get(k + "eos_token_id", 2)),
            unk_id=_opt_int(meta.get(k + "unknown_token_id", 0)),
            eot_id=_opt_int(meta.get(k + "eot_token_id")),
            eom_id=_opt_int(meta.get(k + "eom_token_id")),
            add_bos=bool(meta.get(k + "add_bos_token", True)),
            add_space_prefix=bool(meta.get(k + "add_space_prefix", True)),
            model_name=str(meta.get("general.name", "")),
        )
        return tok

    @staticmethod
    def _attrs_from_types(token_types: Any, n: int) -> list[int]:
        if token_types is None:
            return [int(TokenAttr.NORMAL)] * n
        lut = np.zeros(8, np.int32)  # types 0 and >= 7 -> UNDEFINED
        for t, a in _TYPE_TO_ATTR.items():
            lut[t] = int(a)
        types = np.asarray(token_types, dtype=np.int64)[:n]
        types = np.where((types < 0) | (types > 7), 0, types)
        return lut[types].tolist()

    def _find_eog(self, eot_id: int | None, eom_id: int | None) -> frozenset[int]:
        """EOS, EOT, EOM plus tokens named like end-of-turn; like llama.cpp, force CONTROL on the named."""
        eog = {x for x in (self.eos_id, eot_id, eom_id) if x is not None}
        for name in _EOG_NAMES:
            tid = self._to_id.get(name)
            if tid is not None:
                eog.add(tid)
                self._attr[tid] |= int(TokenAttr.CONTROL)
        return frozenset(eog)

    def _apply_model_quirks(self, model_name: str) -> None:
        """llama.cpp sets LSTRIP/RSTRIP by model name (the GGUF has no per-token attributes)."""
        name = model_name.lower()
        if "phi-3" in name or "phi3" in name:
            for tid, a in enumerate(self._attr):
                if a & (TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN):
                    self._attr[tid] |= int(TokenAttr.RSTRIP)
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                tid = self._to_id.get(text)
                if tid is not None:
                    rstrip = int(TokenAttr.RSTRIP)
                    self._attr[tid] = self._attr[tid] | rstrip if on else self._attr[tid] & ~rstrip

    def _special_groups(self) -> list[tuple[str, list[tuple[int, str]]]]:
        """Special tokens in llama.cpp's partition order, grouped by their first two characters.

        llama.cpp sorts ``cache_special_tokens`` by byte length, longest first, with std::sort (ties in
        unspecified order; harmless for Gemma 3, where no two equal-length special texts can overlap).
        The grouping only lets ``encode`` skip, with one substring test, groups absent from the text.
        """
        mask = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
        ids = np.flatnonzero(np.asarray(self._attr, dtype=np.int64) & mask).tolist()
        ids.sort(key=lambda i: -len(self._text[i].encode()))
        self._special_order = ids
        groups: dict[str, list[tuple[int, str]]] = {}
        for i in ids:
            groups.setdefault(self._text[i][:2], []).append((i, self._text[i]))
        return list(groups.items())

    def _lookup_byte(self, b: int) -> int | None:
        """llama.cpp's byte_to_token: ``<0xXX>`` (upper-case hex), else the one-byte character itself."""
        tid = self._to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._to_id.get(chr(b))
        return tid

    # -- encode --------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """llama.cpp ``llama_tokenize(text, add_special=add_bos, parse_special)`` for an SPM vocab.

        ``add_bos`` adds BOS only when the vocab's ``add_bos_token`` is set (llama.cpp's add_special).
        """
        if parse_special and isinstance(text, TemplateText):
            return self.encode_template(text, add_bos)
        out: list[int] = []
        if add_bos and self.add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        prev_special = True  # a space prefix goes before the first fragment too
        for frag in self._partition(text, parse_special) if text else []:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._spm(frag.replace(" ", SPACE_MARK), out)
            prev_special = False
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut ``text`` at special tokens (llama.cpp tokenizer_st_partition): text pieces and token ids.

        Matching on Python ``str`` finds the same occurrences as llama.cpp's byte search because UTF-8
        is self-synchronising and every fragment boundary is a code-point boundary.
        """
        frags: list[str | int] = [text]
        for key, group in self._specials:
            if key not in text:
                continue
            for tid, tok in group:
                if tok not in text:
                    continue
                attr = self._attr[tid]
                if not parse_special and attr & _HIDDEN:
                    continue  # USER_DEFINED tokens still match with parse_special false
                frags = self._split_all(frags, tok, tid, attr)
        return frags

    @staticmethod
    def _split_all(frags: list[str | int], tok: str, tid: int, attr: int) -> list[str | int]:
        """Split every text fragment at each leftmost non-overlapping occurrence of ``tok``."""
        out: list[str | int] = []
        for frag in frags:
            if isinstance(frag, int) or tok not in frag:
                out.append(frag)
                continue
            pos, end = 0, len(frag)
            while pos < end:
                m = frag.find(tok, pos)
                if m < 0:
                    out.append(frag[pos:])
                    break
                left = frag[pos:m]
                if attr & TokenAttr.LSTRIP:
                    left = left.rstrip(_ASCII_SPACE)
                if left:
                    out.append(left)
                out.append(tid)
                pos = m + len(tok)
                if attr & TokenAttr.RSTRIP:
                    while pos < end and frag[pos] in _ASCII_SPACE:
                        pos += 1
        return out

    def _spm(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on one escaped fragment; appends ids to ``out``.

        Symbols are code points at fixed start offsets: symbol ``i`` covers ``text[i:i + size[i]]`` and
        merging only grows the left symbol, so a queued pair (left, right, size) is still current iff
        both sizes are non-zero and add up to ``size`` (llama.cpp's staleness test, in bytes there).
        The heap pops the highest score, ties to the smallest left index (llm_bigram_spm::comparator).
        """
        n = len(text)
        size = [1] * n
        prev, nxt = _index_list(-1, n), _index_list(1, n)
        nxt[-1] = -1
        vocab, scores = self._to_id, self._scores
        heap: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            sz = size[left] + size[right]
            tid = vocab.get(text[left : left + sz])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, sz))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, sz = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != sz:
                continue
            size[left] = sz
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        i = 0
        while i != -1:
            self._emit(text[i : i + size[i]], out)
            i = nxt[i]
        _free(prev, nxt)

    def _emit(self, piece: str, out: list[int]) -> None:
        """llama.cpp resegment(): a symbol in the vocab is one token; otherwise its UTF-8 bytes.

        (llama.cpp's rev_merge lookup never succeeds: only pieces that are tokens are ever merged, so a
        non-token symbol is always a single code point that falls back to byte tokens.)
        """
        tid = self._to_id.get(piece)
        if tid is not None:
            out.append(tid)
            return
        for b in piece.encode("utf-8"):
            bid = self._byte_ids[b]
            if bid is None:  # llama.cpp throws std::out_of_range here
                raise UnencodableText(
                    f"the model's vocabulary cannot encode {piece!r} (U+{ord(piece[0]):04X}): it has no "
                    f"token for it and no byte-fallback token for its byte 0x{b:02X}"
                )
            out.append(bid)

    # -- decode --------------------------------------------------------------------------------------

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """llama.cpp ``token_to_piece(token, lstrip=0, special)``."""
        attr = self._attr[token_id]
        text = self._text[token_id]
        if attr & _HIDDEN:
            return text.encode() if special else b""
        if attr & TokenAttr.USER_DEFINED:
            return text.encode()  # verbatim: U+2581 is NOT turned back into a space here
        if attr & TokenAttr.NORMAL:
            return text.replace(SPACE_MARK, " ").encode()
        if attr & TokenAttr.BYTE:
            return bytes((int(text[3:5], 16),))
        return b""  # UNUSED / UNDEFINED

    def strips_space(self, index: int, emitted: bool) -> bool:
        """llama_detokenize(remove_special=False): with ``add_space_prefix`` only the very first token's
        piece loses a leading space (a leading BOS, empty as it is, uses up the chance). For Gemma 3 the
        flag is false. ``clean_spaces`` is off for SPM vocabs, so nothing else is rewritten: ``decode``
        equals ``llama_detokenize(ids, remove_special=False, unparse_special=not skip_special)``.
        """
        return self.add_space_prefix and index == 0

    def token_id(self, text: str) -> int | None:
        return self._to_id.get(text)

    def control_texts(self) -> list[str]:
        return [self._text[i] for i in self._special_order if self._attr[i] & _HIDDEN]

    def is_special(self, token_id: int) -> bool:
        return bool(self._attr[token_id] & _HIDDEN)

    def token_attr(self, token_id: int) -> TokenAttr:
        """The llama.cpp attribute bits of ``token_id`` (after llama.cpp's load-time fix-ups)."""
        return TokenAttr(self._attr[token_id])

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (U+2581 for spaces, ``<0xXX>`` for bytes)."""
        return self._text[token_id]


def _index_list(start: int, n: int) -> list[int]:
    """``list(range(start, start + n))``, built GIL_SLICE items at a time: over a megabyte prompt's million
    characters one call would hold the GIL, and with it the socket loop, for tens of milliseconds."""
    out: list[int] = []
    for s in range(0, n, GIL_SLICE):
        out.extend(range(start + s, start + min(n, s + GIL_SLICE)))
    return out


def _free(*lists: list) -> None:
    """Empty ``lists`` GIL_SLICE items at a time (freeing a million ints at once holds the GIL as long)."""
    for items in lists:
        while items:
            del items[-GIL_SLICE:]


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _in_range(x: int | None, n: int) -> int | None:
    """llama.cpp disables a special id that is out of the vocabulary."""
    return x if x is not None and 0 <= x < n else None
