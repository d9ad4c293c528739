"""HF ``tokenizer.json`` behind the :class:`hmad.model.tokenizer.Tokenizer` interface (through the
``tokenizers`` package), for models whose GGUF carries no SPM vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hmad.model.tokenizer import SPACE_MARK, TemplateText, Tokenizer

_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (tokenizer.json) behind the same interface.

    Pieces become bytes by the file's decoder: ByteLevel (GPT-2 style) maps characters back to bytes;
    otherwise U+2581 -> space and ``<0xXX>`` byte-fallback pieces -> that byte. Special added tokens
    are hidden unless asked for; other added tokens are copied verbatim.
    """

    def __init__(
        self,
        tk: Any,
        bos_id: int | str | None = None,
        eos_id: int | str | None = None,
        eot_ids: Iterable[int | str] = (),
    ):
        self._tk = tk
        spec = json.loads(tk.to_str())
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self._special_texts = [t["content"] for t in spec.get("added_tokens", []) if t.get("special")]
        self._added = {t["id"] for t in spec.get("added_tokens", [])}
        decoders = _flatten_decoders(spec.get("decoder"))
        self._byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
        self._byte_decoder = _gpt2_byte_decoder() if self._byte_level else {}
        self.strip_first_space = any(_strips_first_space(d) for d in decoders)
        self.bos_id = self._resolve(bos_id, _BOS_NAMES)
        self.eos_id = self._resolve(eos_id, _EOS_NAMES)
        eot = {self._resolve(x, ()) for x in eot_ids} | {self.eos_id}
        eot |= {self.token_id(n) for n in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>")}
        self.eot_ids = frozenset(x for x in eot if x is not None)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> HFTokenizer:
        """Load ``tokenizer.json``, and the chat template beside it if there is one; ``bos_id``/``eos_id``/
        ``eot_ids`` (ids or token texts) override."""
        from tokenizers import Tokenizer as _HF

        return cls(_HF.from_file(str(path)), **kw)

    def _resolve(self, x: int | str | None, names: Sequence[str]) -> int | None:
        if isinstance(x, int):
            return x
        if isinstance(x, str):
            return self.token_id(x)
        for name in names:
            tid = self.token_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Encode without the file's post-processor; BOS is prepended here when asked for."""
        if parse_special and isinstance(text, TemplateText):
            return self.encode_template(text, add_bos)
        self._tk.encode_special_tokens = not parse_special
        ids = self._tk.encode(text, add_special_tokens=False).ids if text else []
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        piece = self._tk.id_to_token(int(token_id))
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode() if special else b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level:
            return bytes(self._byte_decoder.get(c, 0x3F) for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes((int(piece[3:5], 16),))
        return piece.replace(SPACE_MARK, " ").encode()

    def token_id(self, text: str) -> int | None:
        return self._tk.token_to_id(text)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def control_texts(self) -> list[str]:
        return list(self._special_texts)


def _flatten_decoders(d: dict | None) -> list[dict]:
    if not d:
        return []
    if d.get("type") == "Sequence":
        return [x for sub in d.get("decoders", []) for x in _flatten_decoders(sub)]
    return [d]


def _strips_first_space(d: dict) -> bool:
    """Decoders that drop the space SentencePiece put before the first word."""
    if d.get("type") == "Strip":
        return d.get("content") == " " and int(d.get("start", 0)) >= 1
    if d.get("type") == "Metaspace":
        return d.get("prepend_scheme", "always" if d.get("add_prefix_space", True) else "never") != "never"
    return False
