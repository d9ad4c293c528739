"""Tokenizers: SpmTokenizer against llama.cpp's own ids (fixture), hand-made vocabs, HFTokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hmad.core.errors import UnencodableText
from hmad.model.hf_tokenizer import HFTokenizer
from hmad.model.tokenizer import SpmTokenizer, StreamDecoder, TokenAttr

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_llamacpp.json"
CASES = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
CONTROL_TEXTS = ("<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused")


def _case_id(case: dict) -> str:
    flags = ("" if case["add_bos"] else "nobos-") + ("" if case["special"] else "nospecial-")
    return flags + (ascii(case["text"][:24]) if case["text"] else "empty")


def _detok(case: dict, key: str) -> str:
    if key in case:
        return case[key]
    return bytes.fromhex(case[key + "_hex"]).decode("utf-8", errors="replace")


def read_gguf_metadata(path: Path) -> dict:
    """GGUF metadata as plain values: the package's reader when present, else gguf.GGUFReader (slow)."""
    try:
        from hmad.model.gguf import read_gguf
    except ImportError:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        return {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}
    return read_gguf(path).metadata


# --- the embedded model vs llama.cpp ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma_meta(request) -> dict:
    try:
        path = Path(request.getfixturevalue("embedded_model_path"))
    except Exception as e:  # the default-model package is not installed
        pytest.skip(f"embedded model unavailable: {e}")
    if not path.is_file():
        pytest.skip(f"embedded model not found at {path}")
    return read_gguf_metadata(path)


@pytest.fixture(scope="session")
def gemma_tok(gemma_meta) -> SpmTokenizer:
    return SpmTokenizer.from_gguf_metadata(gemma_meta)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ids_match_llamacpp(gemma_tok, case):
    assert (
        gemma_tok.encode(case["text"], add_bos=case["add_bos"], parse_special=case["special"]) == case["ids"]
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_matches_llamacpp(gemma_tok, case):
    assert gemma_tok.decode(case["ids"]) == _detok(case, "detok")
    assert gemma_tok.decode(case["ids"], skip_special=False) == _detok(case, "detok_special")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_stream_decoder_matches_decode(gemma_tok, case):
    for skip in (True, False):
        sd = StreamDecoder(gemma_tok, skip_special=skip)
        pieces = [sd.feed(i) for i in case["ids"]] + [sd.flush()]
        assert "".join(pieces) == gemma_tok.decode(case["ids"], skip_special=skip)
        full = gemma_tok.decode(case["ids"], skip_special=skip)
        if "\ufffd" not in full:
            assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_round_trip_ordinary_text(gemma_tok):
    ordinary = [c["text"] for c in CASES if not any(s in c["text"] for s in CONTROL_TEXTS + ("\u2581",))]
    assert len(ordinary) > 40
    for text in ordinary:
        assert gemma_tok.decode(gemma_tok.encode(text)) == text


def test_gemma_specials(gemma_tok):
    tok = gemma_tok
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (262144, 2, 1)
    eot = tok.token_id("<end_of_turn>")
    assert tok.eot_ids == {1, eot}
    assert tok.is_special(eot) and tok.is_special(2) and not tok.is_special(tok.token_id("\n"))
    assert tok.token_bytes(eot) == b"" and tok.token_bytes(eot, special=True) == b"<end_of_turn>"
    assert tok.token_bytes(tok.token_id("<0xE2>")) == b"\xe2"
    assert tok.token_bytes(tok.token_id("\u2581world")) == b" world"
    assert tok.token_attr(tok.token_id("  ")) & TokenAttr.USER_DEFINED  # runs of spaces are user-defined
    assert tok.token_id("no such token") is None


def test_stream_decoder_holds_split_characters(gemma_tok):
    text = "\U0010fffd\U000f0000"  # private-use code points: byte-fallback tokens, 4 per character
    ids = gemma_tok.encode(text, add_bos=False)
    assert len(ids) == 8
    sd = StreamDecoder(gemma_tok)
    assert [sd.feed(i) for i in ids] == ["", "", "", "\U0010fffd", "", "", "", "\U000f0000"]
    assert sd.flush() == ""


def test_stream_decoder_flushes_incomplete_tail(gemma_tok):
    ids = gemma_tok.encode("\U0001f600", add_bos=False)  # an emoji: one token
    byte_ids = [gemma_tok.token_id(f"<0x{b:02X}>") for b in "😀".encode()]
    sd = StreamDecoder(gemma_tok)
    assert [sd.feed(i) for i in byte_ids[:3]] == ["", "", ""]
    assert sd.flush() == "\ufffd"
    assert gemma_tok.decode(byte_ids[:3]) == "\ufffd"
    assert gemma_tok.decode(byte_ids) == gemma_tok.decode(ids) == "\U0001f600"


def test_speed(gemma_meta, gemma_tok):
    t0 = time.perf_counter()
    SpmTokenizer.from_gguf_metadata(gemma_meta)
    load = time.perf_counter() - t0
    prompt = (next(c["text"] for c in CASES if len(c["text"]) > 2000) * 2)[:4000]
    t0 = time.perf_counter()
    gemma_tok.encode(prompt)
    encode = time.perf_counter() - t0
    assert load < 2.0, f"vocab load took {load:.2f} s"
    assert encode < 0.5, f"encoding 4000 characters took {encode:.3f} s"


# --- hand-made SPM vocabularies (no model file) -------------------------------------------------------------

N, U, C, D, B = 1, 2, 3, 4, 6  # GGUF token types: normal, unknown, control, user-defined, byte


def tiny_spm(pieces: dict[str, float], **kw) -> SpmTokenizer:
    """ids: 0 <unk> (UNKNOWN), 1 <s>, 2 </s> (CONTROL), 3 <|x|> (USER_DEFINED), 4..259 bytes, then pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<|x|>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    scores = [0.0] * 260 + list(pieces.values())
    types = [U, C, C, D] + [B] * 256 + [N] * len(pieces)
    kw.setdefault("add_space_prefix", False)
    return SpmTokenizer(tokens, scores, types, bos_id=1, eos_id=2, unk_id=0, **kw)


def pieces_of(tok: SpmTokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_spm_merges_best_score_first():
    tok = tiny_spm({"a": -1, "b": -1, "c": -1, "ab": -5, "bc": -2, "abc": -3})
    assert pieces_of(tok, tok.encode("abc", add_bos=False)) == ["abc"]  # bc, then a+bc
    tok = tiny_spm({"a": -1, "b": -1, "c": -1, "ab": -5, "bc": -2})
    assert pieces_of(tok, tok.encode("abc", add_bos=False)) == ["a", "bc"]


def test_spm_ties_merge_leftmost():
    tok = tiny_spm({"a": -1, "aa": -1})
    assert pieces_of(tok, tok.encode("aaa", add_bos=False)) == ["aa", "a"]


def test_spm_byte_fallback_and_spaces():
    tok = tiny_spm({"a": -1, "\u2581": -2, "\u2581a": -1})
    assert pieces_of(tok, tok.encode(" a é", add_bos=False)) == ["\u2581a", "\u2581", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode(" a é")) == " a é"


def test_spm_without_byte_tokens_names_the_unencodable_character():
    """llama.cpp's byte_to_token throws std::out_of_range here; hmad raises UnencodableText (a ValueError)
    naming the character and the byte, which the daemon answers bad_request (test_daemon.py)."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b"]
    tok = SpmTokenizer(tokens, None, [2, 3, 3, 1, 1], add_space_prefix=False)
    assert tok.encode("ab", add_bos=False) == [3, 4]  # ASCII with one-character tokens needs no byte tokens
    for text, char, byte in (("a→b", "U+2192", "0xE2"), ("aBb", "U+0042", "0x42"), ("😀", "U+1F600", "0xF0")):
        with pytest.raises(UnencodableText) as e:
            tok.encode(text)
        assert char in str(e.value) and byte in str(e.value) and "byte-fallback" in str(e.value)
        assert isinstance(e.value, ValueError)
    assert tok.max_token_chars == 5  # "<unk>": encode(text) has at least len(text) / 5 ids


def test_spm_partition_and_parse_special():
    tok = tiny_spm({"a": -1, "<": -1, ">": -1, "/": -1, "s": -1, "|": -1, "x": -1})
    ids = tok.encode("a</s>a<|x|>", add_bos=True, parse_special=True)
    assert pieces_of(tok, ids) == ["<s>", "a", "</s>", "a", "<|x|>"]
    ids = tok.encode("a</s>a<|x|>", add_bos=False, parse_special=False)  # user-defined still matches
    assert pieces_of(tok, ids) == ["a", "<", "/", "s", ">", "a", "<|x|>"]
    assert tok.decode(ids) == "a</s>a<|x|>"


def test_spm_space_prefix_rules():
    tok = tiny_spm({"a": -1, "\u2581": -2, "\u2581a": -1}, add_space_prefix=True)
    # a space goes before the first fragment and after every special token
    ids = tok.encode("a<|x|>a", add_bos=True)
    assert pieces_of(tok, ids) == ["<s>", "\u2581a", "<|x|>", "\u2581a"]
    # llama_detokenize drops the first piece's leading space only when it is the first token
    assert tok.decode(ids[1:]) == "a<|x|> a"
    assert tok.decode(ids) == " a<|x|> a"
    sd = StreamDecoder(tok)
    assert "".join([sd.feed(i) for i in ids[1:]] + [sd.flush()]) == "a<|x|> a"


def test_spm_rstrip_for_phi3_names():
    tok = tiny_spm({"a": -1, "\u2581": -2}, model_name="Phi-3 mini")
    assert pieces_of(tok, tok.encode("a<|x|> \n a", add_bos=False)) == ["a", "<|x|>", "a"]


def test_spm_metadata_defaults():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a"]}
    tok = SpmTokenizer.from_gguf_metadata(meta)
    assert (tok.bos_id, tok.eos_id, tok.add_space_prefix, tok.add_bos) == (1, 2, True, True)
    with pytest.raises(ValueError):
        SpmTokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "gpt2"})


# --- HFTokenizer -------------------------------------------------------------------------------------------

HF_CORPUS = ["hello world", "the tokenizer test", "byte fallback for 日本 and emoji", "hello there world"] * 3


def _unigram_json(tmp_path: Path) -> Path:
    """A small SentencePiece-style Unigram with byte fallback (no pre-tokenizer, spaces as U+2581)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import Unigram

    vocab = [("<pad>", 0.0), ("<eos>", 0.0), ("<bos>", 0.0), ("<unk>", 0.0), ("<end_of_turn>", 0.0)]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁world", "hello", "▁the", "ll", "▁t", "a", "n"]
    vocab += [(p, -float(i)) for i, p in enumerate(pieces, start=1)]
    tk = Tokenizer(Unigram(vocab, unk_id=3, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tk.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"])
    path = tmp_path / "unigram.json"
    tk.save(str(path))
    return path


def _bytelevel_json(tmp_path: Path) -> Path:
    """A GPT-2 style byte-level BPE trained on a few lines."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(HF_CORPUS, trainer)
    path = tmp_path / "bytelevel.json"
    tk.save(str(path))
    return path


HF_TEXTS = ["hello world", " the world", "日本語 😀 café", "<end_of_turn> hello", "tab\tand\nnewline"]


@pytest.mark.parametrize("kind", ["unigram", "bytelevel"])
def test_hf_wrapper_matches_library(tmp_path, kind):
    from tokenizers import Tokenizer

    path = _unigram_json(tmp_path) if kind == "unigram" else _bytelevel_json(tmp_path)
    lib = Tokenizer.from_file(str(path))
    tok = HFTokenizer.from_file(path)
    for text in HF_TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=True)
        sd = StreamDecoder(tok)
        pieces = [sd.feed(i) for i in ids] + [sd.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)
        if "<end_of_turn>" not in text:
            assert tok.decode(ids) == text


def test_hf_specials_and_byte_fallback(tmp_path):
    tok = HFTokenizer.from_file(_unigram_json(tmp_path))
    eot = tok.token_id("<end_of_turn>")
    assert (tok.bos_id, tok.eos_id) == (2, 1)
    assert tok.eot_ids == {1, eot}
    assert tok.vocab_size == 5 + 256 + 16
    ids = tok.encode("<end_of_turn>hello", add_bos=True)
    assert ids[:2] == [2, eot] and tok.is_special(eot)
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special=False) == "<bos><end_of_turn>hello"
    # parse_special=False leaves special texts to the model; this Unigram holds "<end_of_turn>" as a piece
    # of its own, so it still comes out whole (as in llama.cpp, where SPM merges may reach control pieces)
    assert tok.encode("<end_of_turn>", add_bos=False, parse_special=False) == [eot]
    bl = HFTokenizer.from_file(_bytelevel_json(tmp_path), bos_id="<s>")
    end = bl.token_id("<|endoftext|>")
    assert (bl.bos_id, bl.eos_id, bl.eot_ids) == (bl.token_id("<s>"), end, {end})
    assert bl.encode("a<|endoftext|>", add_bos=False)[-1] == end
    plain = bl.encode("a<|endoftext|>", add_bos=False, parse_special=False)
    assert end not in plain and bl.decode(plain) == "a<|endoftext|>"
    ids = tok.encode("日", add_bos=False)  # no piece: three byte-fallback tokens
    assert [tok.token_bytes(i) for i in ids] == [b"\xe6", b"\x97", b"\xa5"]
    sd = StreamDecoder(tok)
    assert [sd.feed(i) for i in ids] == ["", "", "日"]
