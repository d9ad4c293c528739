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


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, "5", 2.0, True, [1]])
def test_the_wire_refuses_bad_logprobs_in_one_line(name, bad):
    msg = {"v": 2, "type": "generate", "id": 1, "prompt": "hi", name: bad}
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
