"""Structured output without a daemon: schema compilation errors, the token mask on a tiny SentencePiece
vocabulary checked against a brute-force reference, and the scheduler on a tiny random GGUF (every answer
parses and validates; a schema that cannot be finished ends with "length" and schema_complete false)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
from tiny_gguf import make_tiny_gguf, tiny_vocab

from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import SamplingParams
from hmad.engine.structured import JsonConstraint, Vocabulary, compile_schema
from hmad.model.tokenizer import SpmTokenizer, TokenAttr


@pytest.fixture(scope="module")
def tok() -> SpmTokenizer:
    tokens, scores, types = tiny_vocab()
    return SpmTokenizer(tokens, scores, types, bos_id=2, eos_id=1, unk_id=3, add_space_prefix=False)


@pytest.fixture(scope="module")
def vocab(tok) -> Vocabulary:
    return Vocabulary.of(tok)


# -- compiling ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "string", "pattern": "("}, "unclosed group"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems (3) is greater than maxItems (1)"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
        ({"$ref": "#/definitions/nope"}, "does not exist"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "format": "shoe-size"}, "Unknown format"),
        ([{"type": "string"}], "must be a map"),
    ],
)
def test_uncompilable_schemas_name_the_problem(schema, problem):
    with pytest.raises(ValueError, match="json_schema") as info:
        compile_schema(schema)
    assert problem in str(info.value)


def test_vocabulary_is_built_once_per_tokenizer(tok, vocab):
    assert Vocabulary.of(tok) is vocab
    assert vocab.size == tok.vocab_size == vocab.ll.vocab_size
    assert vocab.eos_ids == sorted(tok.eot_ids)


# -- the mask against a brute-force reference ------------------------------------------------------------


def reference_allowed(tok: SpmTokenizer, text: bytes, answers: list[bytes]) -> set[int]:
    """Tokens whose bytes keep ``text`` a prefix of one of the finite language's ``answers``, plus the
    end-of-turn ids when ``text`` is a whole answer: what the mask must allow, computed independently."""
    allowed = set()
    for i in range(tok.vocab_size):
        piece = tok.token_bytes(i)
        if piece and not tok.is_special(i) and any(a.startswith(text + piece) for a in answers):
            allowed.add(i)
    if text in answers:
        allowed |= set(tok.eot_ids)
    return allowed


def byte_duplicates(tok: SpmTokenizer) -> set[int]:
    """``<0xXX>`` byte tokens whose byte is also a normal token (SentencePiece never emits those)."""
    normal = {tok.token_bytes(i) for i in range(tok.vocab_size) if not tok.token_attr(i) & TokenAttr.BYTE}
    return {
        i
        for i in range(tok.vocab_size)
        if tok.token_attr(i) & TokenAttr.BYTE and tok.token_bytes(i) in normal
    }


@pytest.mark.parametrize(
    "schema, answers, path",
    [
        ({"enum": ["cat", "dog", "do", 12]}, [b'"cat"', b'"dog"', b'"do"', b"12"], '"dog"'),
        ({"enum": ["ab", "abc"]}, [b'"ab"', b'"abc"'], '"abc"'),
        ({"enum": [7, 71, "7"]}, [b"7", b"71", b'"7"'], "71"),
    ],
)
def test_mask_matches_the_reference_along_every_step(tok, vocab, schema, answers, path):
    """A finite language (whitespace may come only before these answers, where the reference leaves out
    one space): at each step of writing ``path`` the mask allows only tokens that keep the text a prefix
    of some answer, EOS only at a whole answer, and every such token but a byte token duplicating a normal
    token's byte (llguidance may leave those out: the tokenizer never produces them)."""
    c = JsonConstraint(compile_schema(schema), vocab)
    dups, text = byte_duplicates(tok), b""
    for step in tok.encode(path, add_bos=False):
        allowed = set(np.flatnonzero(c.allowed()).tolist()) - {tok.token_id("▁")}  # leading space
        reference = reference_allowed(tok, text, answers)
        assert reference - dups <= allowed <= reference, text
        assert c.complete == (text in answers) and not c.stopped
        c.accept(step)
        text += tok.token_bytes(step)
    assert text == path.encode() and c.complete and c.stopped  # nothing may follow but end-of-turn
    assert set(np.flatnonzero(c.allowed()).tolist()) == set(tok.eot_ids)


def test_mask_sets_forbidden_logits_to_minus_inf_and_keeps_the_rest(tok, vocab):
    c = JsonConstraint(compile_schema({"type": "boolean"}), vocab)
    logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
    before = logits.copy()
    masked = c.mask(logits)
    allowed = c.allowed()
    assert masked.dtype == np.float32 and np.array_equal(logits, before)  # the input is not modified
    assert np.array_equal(masked[allowed], logits[allowed])
    assert np.all(masked[~allowed] == -np.inf)
    starts = {tok.decode([i])[:1] for i in np.flatnonzero(allowed)}
    assert starts <= {"t", "f", " "}  # "true" / "false", perhaps after one space


def test_whitespace_is_bounded_unless_the_schema_asks_for_compact_json(tok, vocab):
    def after_brace(schema: dict) -> set[str]:
        c = JsonConstraint(compile_schema(schema), vocab)
        c.accept(tok.token_id("<0x7B>"))  # {
        return {tok.token_text(i) for i in np.flatnonzero(c.allowed())}

    assert after_brace({"type": "object"}) == {"<0x22>", "<0x7D>", "<0x20>", "▁", "<0x0A>", "\n"}
    compact = {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    assert after_brace(compact) == {"<0x22>", "<0x7D>"}  # " or }
    c = JsonConstraint(compile_schema({"type": "array"}), vocab)
    for t in tok.encode("[\n\n" + " " * 20, add_bos=False):  # two newlines and 20 blanks: the most
        c.accept(t)
    assert not c.allowed()[tok.token_id("▁")]


def test_a_refused_token_is_an_error_not_a_crash(tok, vocab):
    c = JsonConstraint(compile_schema({"type": "integer"}), vocab)
    with pytest.raises(RuntimeError, match="refused"):
        c.accept(tok.token_id("a"))


# -- the scheduler on a tiny random model ----------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "pet": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "at": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "pet", "n", "ok", "tags", "at"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # compact: a random model would pad with blanks
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=3), backend="cpu")


def test_every_answer_parses_and_validates(tiny_model):
    """Greedy and sampled, several seeds, all in one batch: the random model's text is the grammar's."""
    params = [SamplingParams(temperature=0.0, max_tokens=200)]
    params += [SamplingParams(temperature=t, seed=s, max_tokens=200) for t in (0.7, 1.5) for s in (1, 2, 3)]
    results = generate(tiny_model, ["the cat"] * len(params), params, json_schemas=SCHEMA)
    for r in results:
        assert (r.finish_reason, r.stats["schema_complete"]) == ("stop", True), r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert tiny_model.tokenizer.decode(r.token_ids) == r.text
    assert len({r.text for r in results}) > 1  # sampling still samples


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(tiny_model):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = generate(tiny_model, ["the dog"], plain)[0]
    mixed = generate(tiny_model, ["the dog", "the cat"], plain, json_schemas=[None, {"type": "boolean"}])
    assert mixed[0].token_ids == alone.token_ids and "schema_complete" not in mixed[0].stats
    assert json.loads(mixed[1].text) in (True, False)


def test_a_schema_that_cannot_be_met_in_max_tokens_ends_with_length(tiny_model):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 20}
    r = generate(tiny_model, ["the"], SamplingParams(temperature=0.0, max_tokens=5), json_schemas=schema)[0]
    assert (r.finish_reason, r.stats["schema_complete"], len(r.token_ids)) == ("length", False, 5)
    assert r.text.lstrip().startswith("[")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_a_stop_string_inside_the_json_reports_it_incomplete(tiny_model):
    r = generate(
        tiny_model,
        ["the"],
        SamplingParams(temperature=0.0, max_tokens=50, stop=['"']),
        json_schemas={"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
    )[0]
    assert (r.finish_reason, r.stats["schema_complete"]) == ("stop", False)
    assert '"' not in r.text


def test_hmad_generate_with_a_json_schema(tmp_path):
    model = make_tiny_gguf(tmp_path / "tiny.gguf", seed=3)
    schema = json.dumps({"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 2, "maxItems": 2})
    cmd = [sys.executable, "-m", "hmad", "generate", "--model", str(model), "--max-tokens", "60"]
    cmd += ["--temperature", "0"]  # greedy: hmad generate samples as the daemon does by default
    run = subprocess.run([*cmd, "--json-schema", schema, "--json", "the"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert (out["finish_reason"], out["schema_complete"]) == ("stop", True)
    assert all(x in ("cat", "dog") for x in json.loads(out["text"])) and len(json.loads(out["text"])) == 2
    bad = subprocess.run([*cmd, "--json-schema", '{"type": "strin"}', "the"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Invalid type: strin" in bad.stderr
