"""OpenAI's logit_bias, presence_penalty and frequency_penalty (engine/sampling.py, step 0) on the host: the
deltas against a numpy reference on fresh random inputs, what they do to greedy and sampled tokens, the
candidates path against whole rows, and the wire's and the engine's checks of their values."""

from __future__ import annotations

import numpy as np
import pytest

from hmaclient import protocol as P
from hmaclient import sampling as fields
from hmad.engine.sampling import Sampler, SamplingParams


def reference(logits: np.ndarray, bias: dict[int, float], presence: float, frequency: float, generated):
    """The adjusted row, written from OpenAI's formula: logit[j] + bias[j] - (presence * (count[j] > 0) +
    frequency * count[j]), the delta in float64 rounded once to float32, then one float32 add."""
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=logits.size)
    delta = np.zeros(logits.size)
    for t, b in bias.items():
        delta[t] = b
    seen = counts > 0
    delta[seen] = delta[seen] - (presence + frequency * counts[seen])
    out = logits.astype(np.float32, copy=True)
    hit = delta != 0
    out[hit] += delta[hit].astype(np.float32)
    return out


def _random_case(rng, vocab=1000):
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(vocab, int(rng.integers(0, 300)))}
    pool = rng.choice(vocab, int(rng.integers(1, 40)))
    generated = [int(t) for t in rng.choice(pool, int(rng.integers(0, 200)))]
    presence, frequency = (float(x) for x in rng.uniform(-2, 2, 2))
    logits = (rng.standard_normal(vocab) * 5).astype(np.float32)
    return logits, bias, presence, frequency, generated


def test_adjusted_rows_equal_the_numpy_reference():
    """Fresh random rows, biases, penalties and histories; the same row counted all at once and token by
    token (the engine's growing output_ids) gives bit-identical rows."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        logits, bias, presence, frequency, generated = _random_case(rng)
        p = SamplingParams(logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency)
        p.validate()
        want = reference(logits, bias, presence, frequency, generated)
        got = Sampler(p).adjust(logits, generated)
        assert np.array_equal(got, want), seed
        assert got is not logits and logits.dtype == np.float32  # the caller's row untouched
        s, grown = Sampler(p), []
        for t in generated[:30]:
            grown.append(t)
            assert np.array_equal(
                s.adjust(logits, grown), reference(logits, bias, presence, frequency, grown)
            )


def test_nothing_to_adjust_returns_the_row_itself():
    row = np.arange(10, dtype=np.float32)
    s = Sampler(SamplingParams(repetition_penalty=1.3))
    assert s.adjust(row, [1, 2]) is row
    ids, deltas = s.adjustments([1, 2])
    assert ids.size == deltas.size == 0


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it():
    rng = np.random.default_rng()
    for _ in range(10):
        row = rng.uniform(-10, 10, 500).astype(np.float32)
        top, second = np.argsort(-row)[:2]
        pick = int(rng.integers(500))
        for temperature in (0.0, 1.0):
            forced = SamplingParams(temperature=temperature, seed=1, logit_bias={str(pick): 100})
            forced.validate()
            assert Sampler(forced).sample(row) == pick
        banned = SamplingParams(temperature=0.0, logit_bias={int(top): -100})
        banned.validate()
        assert Sampler(banned).sample(row) == second


def test_presence_and_frequency_penalties_change_tokens_as_computed():
    """A greedy row whose top token leads by 1.0: generated twice, a presence penalty of 0.6 leaves it on
    top (1.0 - 0.6 > 0), adding a frequency penalty of 0.3 (0.6 + 2 x 0.3 = 1.2) puts the runner-up first;
    negative penalties lift a generated token over the top one."""
    row = np.zeros(50, np.float32)
    row[7], row[3], row[11] = 5.0, 4.0, 3.5
    gen = [7, 7, 11]

    def pick(**kw):
        return Sampler(SamplingParams(temperature=0.0, **kw)).sample(row, [], gen)

    assert pick() == 7
    assert pick(presence_penalty=0.6) == 7
    assert pick(presence_penalty=0.6, frequency_penalty=0.3) == 3
    assert pick(frequency_penalty=-1.0) == 7
    lifted = SamplingParams(temperature=0.0, frequency_penalty=-1.0)  # 3.5 + 2 x 1.0 over 5
    assert Sampler(lifted).sample(row, [], [11, 11]) == 11
    assert pick(presence_penalty=0.9, frequency_penalty=-0.5, logit_bias={3: -0.5}) == 7
    for kw in [dict(presence_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=-1.5)]:
        want = int(
            np.argmax(reference(row, {}, kw.get("presence_penalty", 0), kw.get("frequency_penalty", 0), gen))
        )
        assert pick(**kw) == want, kw


def test_candidates_of_the_adjusted_row_give_the_whole_rows_token():
    """The device adds the deltas before its top-k; the host then draws from those candidates (repetition
    penalty after the additive adjustments, as on whole rows): the same token as sampling the whole row,
    on fresh random rows and settings."""
    rng = np.random.default_rng()
    for i in range(60):
        logits, bias, presence, frequency, generated = _random_case(rng)
        kw = dict(
            temperature=float(rng.choice([0.0, 0.7, 2.0])),
            top_k=int(rng.choice([1, 5, 40, 64])),
            top_p=float(rng.choice([1.0, 0.9])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            seed=i,
        )
        p = SamplingParams(logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency, **kw)
        p.validate()
        recent = generated[-64:]
        whole = Sampler(p).sample(logits, recent, generated)
        s = Sampler(p)
        adjusted = s.adjust(logits, generated)
        m = s.candidates_needed(recent)
        assert m is not None
        top = np.argsort(-adjusted, kind="stable")[: max(m, 128)]
        assert s.sample_candidates(top, adjusted[top], recent) == whole, kw


BAD = [
    ("presence_penalty", "x", "presence_penalty must be a number in [-2, 2], got 'x'"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ("frequency_penalty", -2.01, "frequency_penalty must be a number in [-2, 2], got -2.01"),
    ("frequency_penalty", True, "frequency_penalty must be a number in [-2, 2], got True"),
    ("logit_bias", [1, 2], "logit_bias must be a map of at most 300 token ids"),
    ("logit_bias", {"12": "x"}, "logit_bias['12'] must be a number in [-100, 100], got 'x'"),
    ("logit_bias", {"12": 100.5}, "logit_bias['12'] must be a number in [-100, 100], got 100.5"),
    ("logit_bias", {"abc": 1}, "logit_bias keys must be token ids (integers from 0 to 2^31-1), got 'abc'"),
    ("logit_bias", {"-3": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"1.5": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias has 301 entries, over the limit of 300"),
    ("logit_bias", {"5": 1, 5: 2}, "logit_bias gives token 5 twice"),
]


@pytest.mark.parametrize(("name", "value", "says"), BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_the_wire_and_the_engine_refuse_bad_values_in_one_line(name, value, says):
    msg = {"v": 3, "type": "generate", "id": "r", "prompt": "hi", name: value}
    with pytest.raises(P.ProtocolError) as e:
        P.validate_request(msg, "r")
    assert e.value.code == P.BAD_REQUEST and e.value.message.startswith(says) and "\n" not in e.value.message
    with pytest.raises(ValueError, match="^" + name) as e2:
        SamplingParams.from_dict({name: value})
    assert "\n" not in str(e2.value) and str(e2.value) == e.value.message


def test_the_wire_form():
    """OpenAI's: string keys (msgpack maps of the wire), at most 300; kept as {int: float}."""
    bias = {str(i): (-1) ** i * 100 for i in range(300)}
    req = P.parse_request(P.pack(P.generate_request("r", "hi", logit_bias=bias, presence_penalty=-2,
                                                     frequency_penalty=1.25)))  # fmt: skip
    assert req.logit_bias == {i: float((-1) ** i * 100) for i in range(300)}
    assert (req.presence_penalty, req.frequency_penalty) == (-2.0, 1.25)
    p = SamplingParams(**req.sampling())
    p.validate()
    assert p.logit_bias == req.logit_bias and p.adjusts and p.counts_matter
    # a Python caller's int ids: generate_request gives the frame's string keys (to_wire)
    msg = P.generate_request("r", "hi", logit_bias={7: 1.5, "9": -2})
    assert msg["logit_bias"] == {"7": 1.5, "9": -2}
    assert P.parse_request(P.pack(msg)).logit_bias == {7: 1.5, 9: -2.0}
    assert fields.to_wire("logit_bias", [7]) == [7] and fields.to_wire("top_k", 3) == 3


def test_token_ids_are_checked_against_the_vocabulary():
    p = SamplingParams.from_dict({"logit_bias": {"99": 1.0, "100": -1}})
    p.check_vocab(101)
    with pytest.raises(ValueError, match="^logit_bias token 100 is outside the model's vocabulary of 100"):
        p.check_vocab(100)
    with pytest.raises(ValueError, match="logit_bias token 100 is outside the vocabulary of 100 tokens"):
        Sampler(p).sample(np.zeros(100, np.float32))


def test_flags_and_defaults():
    """``--logit-bias ID=BIAS`` (repeatable) gives the wire's map; the table's default is no entry."""
    import argparse

    ap = argparse.ArgumentParser()
    fields.add_flags(ap)
    args = ap.parse_args(["--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--presence-penalty", "0.5"])
    assert fields.from_args(args) == {"logit_bias": {"5": -100.0, "7": 2.5}, "presence_penalty": 0.5}
    with pytest.raises(SystemExit):
        ap.parse_args(["--logit-bias", "x=1"])
    assert SamplingParams().logit_bias == {} and not SamplingParams().adjusts
    assert SamplingParams(**{**fields.DEFAULTS, "stop": []}).logit_bias == {}
