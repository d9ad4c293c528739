"""Logprobs: engine/logprobs.py against a float64 hand computation on random rows; the wire's check of
``logprobs`` and the replies that carry them, packed and parsed; the sampler's prepared row is the one
it picks from."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hmaclient import protocol as P
from hmaclient import sampling
from hmaclient.reply import Logprob
from hmad.engine import logprobs as L
from hmad.engine.sampling import Sampler, SamplingParams


def _reference(row: np.ndarray) -> list[float]:
    """log_softmax in float64, written out: log(exp(x_i) / sum_j exp(x_j)) with Python floats and fsum."""
    xs = [float(x) for x in row]
    m = max(xs)
    total = math.fsum(math.exp(x - m) for x in xs if x != -math.inf)
    return [x - m - math.log(total) if x != -math.inf else -math.inf for x in xs]


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_log_softmax_equals_the_float64_reference_on_random_rows(scale):
    rng = np.random.default_rng(int(scale))
    for _ in range(5):
        row = (rng.standard_normal(4096) * scale).astype(np.float32)
        row[rng.integers(0, row.size, 7)] = -np.inf  # a grammar's mask
        lp = L.log_softmax(row)
        ref = np.array(_reference(row))
        finite = np.isfinite(ref)
        assert np.array_equal(finite, np.isfinite(lp))
        np.testing.assert_allclose(lp[finite], ref[finite], rtol=0, atol=1e-6)  # float32 exponentials
        assert (lp[finite] <= 0).all() and math.isclose(math.fsum(np.exp(lp[finite])), 1.0, rel_tol=1e-6)


def test_top_is_sorted_ties_by_lower_id_and_skips_masked_tokens():
    row = np.array([1.0, 3.0, 3.0, -np.inf, 2.0, 3.0, np.nan], dtype=np.float32)
    assert L.top(row, 3) == [1, 2, 5]  # three equal: by id
    assert L.top(row, 2) == [1, 2]  # the edge's ties by id too
    assert L.top(row, 20) == [1, 2, 5, 4, 0]  # the masked ones (and NaN, counted as -inf) never
    assert L.top(row, 0) == []
    assert L.entry(row, 6, 2, str)["logprob"] == -np.inf
    rng = np.random.default_rng(1)
    for n in (1, 5, 20):
        row = rng.standard_normal(1000).astype(np.float32)
        got = L.top(row, n)
        assert got == np.argsort(-row.astype(np.float64), kind="stable")[:n].tolist()
        values = [v for _, v, _ in L.entry(row, 0, n, str)["top"]]
        assert values == sorted(values, reverse=True)


def test_entry_is_the_chosen_tokens_logprob_and_its_alternatives():
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float64)).astype(np.float32)
    e = L.entry(row, 2, 2, lambda i: f"t{i}")
    assert e["token_id"] == 2 and e["text"] == "t2"
    assert math.isclose(e["logprob"], math.log(0.125), abs_tol=1e-6)
    assert [a[0] for a in e["top"]] == [0, 1] and [a[2] for a in e["top"]] == ["t0", "t1"]
    assert math.isclose(e["top"][0][1], math.log(0.5), abs_tol=1e-6)
    assert L.entry(row, 0, 0, str)["top"] == []


def test_logprobs_are_of_the_adjusted_row_before_temperature():
    """The prepared row has logit_bias and the repetition penalty in it; temperature does not change it."""
    row = np.zeros(16, dtype=np.float32)
    p = SamplingParams(temperature=0.5, logit_bias={3: 2.0}, repetition_penalty=2.0, logprobs=1)
    p.validate()
    prepared = Sampler(p).prepare(row - 1.0, recent_tokens=[5])
    assert prepared[3] == 1.0 and prepared[5] == -2.0 and prepared[0] == -1.0
    assert Sampler(p).pick(prepared) in range(16)
    assert L.top(prepared, 1) == [3]


def _device_candidates(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """What the device's top-k tail gives for ``row``: its ``k`` best (ids, values) in shaders/topk.comp's
    order (NaN as -inf; ties by lower id), and the row's log-sum-exp rounded to float32."""
    x = np.where(np.isnan(row), np.float32(-np.inf), row)
    ids = np.lexsort((np.arange(x.size), -x))[:k]
    return ids, row[ids], np.float32(L.logsumexp(row))


def test_the_candidates_entry_equals_the_rows():
    """On random rows with ties, a grammar's -inf and a NaN: the entry from the candidates and the row's
    float32 log-sum-exp equals the one from the whole row, the alternatives in the same order, within the
    float32 rounding of the log-sum-exp."""
    rng = np.random.default_rng(5)
    for trial in range(20):
        row = (rng.standard_normal(3000) * 4).astype(np.float32)
        row[rng.integers(0, row.size, 40)] = row.max()  # ties at the top, across the edge of the k
        row[rng.integers(0, row.size, 5)] = -np.inf
        row[7] = np.nan
        ids, vals, lse = _device_candidates(row, 64)
        order = rng.permutation(ids.size) if trial % 2 else np.arange(ids.size)  # in any order
        for n in (0, 1, 5, 20):
            tok = int(ids[rng.integers(0, ids.size)])
            got = L.entry_from_candidates(ids[order], vals[order], float(lse), tok, n, str)
            want = L.entry(row, tok, n, str)
            assert got["token_id"] == tok and got["text"] == want["text"]
            assert math.isclose(got["logprob"], want["logprob"], rel_tol=0, abs_tol=1e-5)
            assert [a[0] for a in got["top"]] == [a[0] for a in want["top"]]
            pairs = zip(got["top"], want["top"], strict=True)
            assert all(math.isclose(a[1], b[1], abs_tol=1e-5) for a, b in pairs)
    # a row with fewer finite values than candidates: the masked ones are never alternatives
    row = np.full(300, -np.inf, np.float32)
    row[[3, 9, 200]] = [1.0, 2.0, 2.0]
    ids, vals, lse = _device_candidates(row, 128)
    got = L.entry_from_candidates(ids, vals, float(lse), 3, 20, str)
    assert [a[0] for a in got["top"]] == [9, 200, 3] == [a[0] for a in L.entry(row, 3, 20, str)["top"]]


def test_the_candidates_entry_refuses_a_row_without_a_distribution():
    ids, vals = np.array([4, 2]), np.array([1.0, 0.5], np.float32)
    for lse in (float("-inf"), float("inf"), float("nan")):
        with pytest.raises(ValueError, match="no finite maximum"):
            L.entry_from_candidates(ids, vals, lse, 4, 1, str)
    with pytest.raises(ValueError, match="not among"):
        L.entry_from_candidates(ids, vals, 1.5, 3, 1, str)


def test_the_target_entry_equals_the_rows():
    """A prompt token's entry from its row's candidates, log-sum-exp and the token's own logit (gathered
    whether or not it is a candidate; NaN counts as -inf) equals the whole row's, alternatives too."""
    rng = np.random.default_rng(6)
    row = (rng.standard_normal(3000) * 4).astype(np.float32)
    row[rng.integers(0, row.size, 5)] = -np.inf
    row[7] = np.nan
    ids, vals, lse = _device_candidates(row, 64)
    outside = [int(t) for t in np.argsort(row)[:100] if t not in set(ids.tolist())]
    masked = int(np.flatnonzero(row == -np.inf)[0])
    for tok in (int(ids[0]), int(ids[-1]), outside[0], outside[-1], 7, masked):
        for n in (0, 5, 20):
            got = L.entry_from_target(ids, vals, float(lse), tok, row[tok], n, str)
            want = L.entry(row, tok, n, str)
            assert got["token_id"] == tok and got["text"] == want["text"]
            if tok in (7, masked):  # NaN and -inf: -inf
                assert got["logprob"] == want["logprob"] == -np.inf
            else:
                assert math.isclose(got["logprob"], want["logprob"], rel_tol=0, abs_tol=1e-5)
            assert [a[0] for a in got["top"]] == [a[0] for a in want["top"]]
    with pytest.raises(ValueError, match="no finite maximum"):
        L.entry_from_target(ids, vals, float("nan"), 3, 1.0, 1, str)


def test_prompt_entries_from_candidate_rows(tmp_path):
    """TokenTaker.sample_candidates on a step holding two chunks' rows of a prompt-logprobs request beside
    a decoding one: each prompt row gives the entry of the prompt token after it from its candidates,
    log-sum-exp and gathered logit, as TokenTaker.sample gives it from the whole rows; the chunk that ends
    the prompt draws the first token from its last row; the other request's row is its own."""
    from tiny_gguf import make_tiny_gguf

    from hmad.engine.request import Request, State
    from hmad.engine.tokens import TokenTaker
    from hmad.model.loader import read_model_files

    tok = read_model_files(make_tiny_gguf(tmp_path / "tiny.gguf")).tokenizer
    rng = np.random.default_rng(8)
    prompt = [int(t) for t in rng.integers(1, 300, 7)]

    def requests():
        p = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=2)
        p.validate()
        lp = Request(0, list(prompt), p, state=State.PREFILL)
        q = SamplingParams(temperature=0.0, max_tokens=4)
        q.validate()
        dec = Request(1, [5, 6], q, state=State.DECODE, n_cached=3, output_ids=[9])
        for r in (lp, dec):
            r.start(tok)
        return lp, dec

    got, want = requests(), requests()
    for chunk in ([0, 4], [4, 7]):  # positions 0-3, then 4-6 (the prompt's last: the token's row)
        rows = (rng.standard_normal((chunk[1] - chunk[0] + 1, 300)) * 3).astype(np.float32)
        for lp, _ in (got, want):
            lp.n_cached, lp.step_rows = chunk[1], chunk[1] - chunk[0]
        cands = [_device_candidates(r, 64) for r in rows]
        ids, vals = np.stack([c[0] for c in cands]), np.stack([c[1] for c in cands])
        lse = np.array([c[2] for c in cands], np.float32)
        targets = np.full(len(rows), np.nan, np.float32)
        for j, pos in enumerate(range(*chunk)):
            if pos + 1 < len(prompt):
                targets[j] = rows[j, prompt[pos + 1]]
        ev_got = TokenTaker(eot=set(), context=64).sample_candidates(list(got), ids, vals, lse, targets)
        ev_want = TokenTaker(eot=set(), context=64).sample(list(want), rows)
        assert [(e.kind, e.request_id, e.token_ids) for e in ev_got] == [
            (e.kind, e.request_id, e.token_ids) for e in ev_want
        ]
    (lp, _), (lp_want, _) = got, want
    assert len(lp.prompt_logprobs) == len(prompt) and lp.prompt_logprobs[0] is None
    for a, b in zip(lp.prompt_logprobs[1:], lp_want.prompt_logprobs[1:], strict=True):
        assert a["token_id"] == b["token_id"] and math.isclose(a["logprob"], b["logprob"], abs_tol=1e-5)
        assert [t[0] for t in a["top"]] == [t[0] for t in b["top"]] and len(a["top"]) == 3
    assert lp.output_ids == lp_want.output_ids and len(lp.output_ids) == 1


def test_a_row_without_a_distribution_fails_its_request_alone(tmp_path):
    """TokenTaker.sample_candidates with a non-finite log-sum-exp on one row: that request ends with an
    error naming it, the other gets its token and its logprobs entry from the candidates."""
    from tiny_gguf import make_tiny_gguf

    from hmad.engine.request import Request, State
    from hmad.engine.tokens import TokenTaker
    from hmad.model.loader import read_model_files

    tok = read_model_files(make_tiny_gguf(tmp_path / "tiny.gguf")).tokenizer
    reqs = []
    for i in range(2):
        p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
        p.validate()
        reqs.append(Request(i, [5, 6], p, state=State.PREFILL, n_cached=2))
        reqs[-1].start(tok)
    ids = np.array([[40, 41, 42], [40, 41, 42]])
    vals = np.array([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]], np.float32)
    lse = np.array([np.nan, 3.5], np.float32)
    events = TokenTaker(eot=set(), context=64).sample_candidates(reqs, ids, vals, lse)
    errors = [e for e in events if e.kind == "error"]
    assert [e.request_id for e in errors] == [0] and "no finite maximum" in errors[0].text
    (token,) = [e for e in events if e.kind == "token"]
    assert token.request_id == 1 and token.token_ids == [40]
    (entry,) = token.logprobs
    assert entry["token_id"] == 40 and math.isclose(entry["logprob"], -0.5)
    assert [a[0] for a in entry["top"]] == [40, 41] and math.isclose(entry["top"][1][1], -1.5)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, "5", 2.0, True, [1]])
def test_the_wire_refuses_bad_logprobs_in_one_line(name, bad):
    msg = {"v": 3, "type": "generate", "id": 1, "prompt": "hi", name: bad}
    with pytest.raises(P.ProtocolError) as e:
        P.validate_request(msg, 1)
    assert e.value.code == P.BAD_REQUEST
    assert e.value.message.startswith(f"{name} must be an integer from 0 to 20, or null (none), got")
    assert "\n" not in e.value.message
    with pytest.raises(ValueError, match=f"{name} must be"):
        SamplingParams(**{name: bad}).validate()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("good", [0, 5, sampling.MAX_LOGPROBS, None])
def test_the_wire_takes_logprobs_to_the_sampling_params(name, good):
    msg = P.generate_request(1, "hi", **{name: good})
    assert (name in msg) == (good is not None)
    req = P.validate_request(msg, 1)
    assert getattr(req, name) == good
    params = SamplingParams(**req.sampling())
    params.validate()
    assert getattr(params, name) == good


def test_replies_carry_logprobs_both_ways():
    entry = {"token_id": 7, "text": "a", "logprob": -0.5, "top": [[7, -0.5, "a"], [9, -1.5, "b"]]}
    tok = P.parse_reply(P.pack(P.token(1, "a", [7], logprobs=[entry])))
    assert tok.logprobs == [Logprob(7, "a", -0.5, [(7, -0.5, "a"), (9, -1.5, "b")])]
    assert P.parse_reply(P.pack(P.token(1, "a", [7]))).logprobs is None
    done = P.done(1, "stop", 3, 1, 0.1, 0.0, 0.2, text="a", token_ids=[7], logprobs=[entry])
    d = P.parse_reply(P.pack(done))
    assert d.logprobs == tok.logprobs and "logprobs" not in d.extra
    done["prompt_logprobs"] = [None, entry]
    assert P.parse_reply(P.pack(done)).prompt_logprobs == [None, *tok.logprobs]
    with pytest.raises(P.ProtocolError):
        P.parse_reply(P.pack({**done, "prompt_logprobs": [entry]}))  # the first prompt token has none
    bad = {**P.token(1, "a", [7]), "logprobs": [{"token_id": 7}]}
    with pytest.raises(P.ProtocolError):
        P.parse_reply(P.pack(bad))
