"""Sampler and SamplingParams: each pipeline stage on crafted logits, distributions, seeds, validation."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError
from tiny_gguf import make_tiny_gguf

from hmaclient import sampling as fields
from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import Sampler, SamplingParams, _draw, _nucleus
from hmad.engine.sampling_schema import sampling_model

V_BIG = 262144


def _sampler(**kw) -> Sampler:
    kw.setdefault("seed", 1234)
    return Sampler(SamplingParams(**kw))


def _draw_counts(sampler: Sampler, logits: np.ndarray, n: int, recent=()) -> np.ndarray:
    counts = np.zeros(logits.size, dtype=np.int64)
    for _ in range(n):
        counts[sampler.sample(logits, recent)] += 1
    return counts


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax_on_random_logits():
    rng = np.random.default_rng(0)
    s = _sampler(temperature=0.0)
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(logits, []) == int(np.argmax(logits))


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert _sampler(temperature=0.0).sample(logits) == 1


def test_caller_logits_are_not_modified():
    logits = np.array([2.0, -1.0, 0.5], dtype=np.float32)
    before = logits.copy()
    _sampler(temperature=0.0, repetition_penalty=2.0).sample(logits, [0, 1])
    np.testing.assert_array_equal(logits, before)


# --- temperature --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.5], dtype=np.float32)
    n = 20_000
    counts = _draw_counts(_sampler(temperature=temperature, seed=7), logits, n)
    expected = n * _softmax(logits.astype(np.float64) / temperature)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 23.5) ~ 1e-4, so a correct sampler fails about once in 10k seeds
    # (and with a fixed seed, never); a wrong temperature moves chi2 into the hundreds.
    assert chi2 < 23.5, (counts, expected)


def test_low_temperature_concentrates_on_argmax():
    logits = np.array([1.0, 2.0, 1.5], dtype=np.float32)
    counts = _draw_counts(_sampler(temperature=0.01), logits, 500)
    assert counts[1] == 500


# --- top-k --------------------------------------------------------------------------------------


def test_top_k_1_is_argmax():
    rng = np.random.default_rng(1)
    s = _sampler(temperature=1.5, top_k=1)
    for _ in range(20):
        logits = rng.standard_normal(V_BIG).astype(np.float32)
        assert s.sample(logits) == int(np.argmax(logits))


def test_top_k_keeps_exactly_the_k_largest():
    logits = np.array([0.0, 5.0, 1.0, 4.0, 3.0, 2.0], dtype=np.float32)  # top 3: ids 1, 3, 4
    counts = _draw_counts(_sampler(temperature=3.0, top_k=3), logits, 3000)
    assert set(np.flatnonzero(counts)) == {1, 3, 4}


def test_top_k_larger_than_vocab_is_off():
    logits = np.zeros(4, dtype=np.float32)
    counts = _draw_counts(_sampler(top_k=100), logits, 2000)
    assert np.all(counts > 0)


# --- top-p --------------------------------------------------------------------------------------


def test_tiny_top_p_is_argmax():
    rng = np.random.default_rng(2)
    s = _sampler(top_p=1e-6)
    for _ in range(10):
        logits = rng.standard_normal(V_BIG).astype(np.float32)
        assert s.sample(logits) == int(np.argmax(logits))


def test_top_p_keeps_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: p=0.7 needs {0, 1} (0.8); p=0.85 needs {0, 1, 2} (0.95).
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    for top_p, kept in [(0.7, {0, 1}), (0.85, {0, 1, 2}), (0.5, {0})]:
        counts = _draw_counts(_sampler(top_p=top_p), logits, 3000)
        assert set(np.flatnonzero(counts)) == kept, top_p


def test_top_p_on_nearly_flat_big_vocab_keeps_most_tokens():
    logits = np.zeros(V_BIG, dtype=np.float32)
    logits[:10] = 1.0
    s = _sampler(top_p=0.99)
    picks = {s.sample(logits) for _ in range(200)}
    assert len(picks) > 150 and all(0 <= t < V_BIG for t in picks)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0, 20.0])
def test_nucleus_matches_full_sort_reference(scale):
    rng = np.random.default_rng(int(scale * 10))
    for _ in range(20):
        n = int(rng.integers(1, 5000))
        logits = (rng.standard_normal(n) * scale).astype(np.float32)
        logits[rng.random(n) < 0.1] = -np.inf  # zero weights must never be needed
        logits[0] = max(logits[0], 0.0)  # at least one finite logit
        weights = np.exp(logits - logits.max())
        top_p = float(rng.uniform(0.01, 1.0))
        kept = _nucleus(weights, top_p)
        # Reference: sort everything, keep the shortest prefix reaching top_p of the mass.
        order = np.argsort(-weights.astype(np.float64), kind="stable")
        cum = np.cumsum(weights[order], dtype=np.float64)
        m = min(int(np.searchsorted(cum, top_p * cum[-1])) + 1, n)
        assert len(kept) == len(set(kept.tolist())) == m
        # Same multiset of weights (ties at the boundary may pick different ids of equal weight).
        np.testing.assert_array_equal(np.sort(weights[kept]), np.sort(weights[order[:m]]))


def test_nucleus_with_top_p_a_hair_under_one_keeps_everything_it_must():
    """top_p the largest float under 1 over whole 262,144-token rows: the buckets' float64 sums can fall a
    hair under top_p times the row's sum (another order of the same additions), which left the boundary
    bucket empty and raised (the request fuzz's "taking the next token failed"). Now at least the
    reference's shortest prefix reaching top_p of its own sum is kept (every bucket, in that case)."""
    rng = np.random.default_rng(1)
    top_p = float(np.nextafter(1.0, 0.0))
    for _ in range(30):
        logits = rng.normal(0.0, rng.choice([0.5, 2.0, 5.0]), 262_144).astype(np.float32)
        weights = np.exp((logits - logits.max()) / np.float32(rng.choice([0.1, 1.0, 3.0])))
        kept = _nucleus(weights, top_p)
        order = np.argsort(-weights.astype(np.float64), kind="stable")
        cum = np.cumsum(weights[order], dtype=np.float64)
        m = min(int(np.searchsorted(cum, top_p * cum[-1])) + 1, len(weights))
        assert len(kept) == len(set(kept.tolist())) >= m
        assert weights[kept].sum(dtype=np.float64) >= top_p * cum[-1] * (1 - 1e-12)
        assert 0 <= _sampler(top_p=top_p).pick(logits) < len(logits)  # a draw over the whole row


def test_draw_never_picks_zero_weight_and_covers_blocks():
    weights = np.zeros(5000, dtype=np.float32)
    weights[[0, 1023, 1024, 4999]] = [1.0, 2.0, 3.0, 4.0]
    picks = [_draw(weights, u) for u in np.linspace(0.0, 1.0, 1001)]  # u = 1.0 is past the end
    assert set(picks) == {0, 1023, 1024, 4999}
    assert picks[0] == 0 and picks[-1] == 4999


def test_top_p_applies_after_top_k():
    # Over all 4 tokens, p=0.6 keeps {0, 1}; over top_k=2 survivors (0.625, 0.375) it keeps only {0}.
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.1]))
    counts = _draw_counts(_sampler(top_k=2, top_p=0.6), logits, 2000)
    assert set(np.flatnonzero(counts)) == {0}


# --- min-p --------------------------------------------------------------------------------------


def test_min_p_excludes_low_tokens_and_keeps_the_rest():
    # probs 0.4, 0.3, 0.2, 0.07, 0.03; min_p=0.25 => threshold 0.1: ids 3 and 4 go.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.07, 0.03]))
    counts = _draw_counts(_sampler(min_p=0.25), logits, 5000)
    assert counts[3] == 0 and counts[4] == 0
    assert np.all(counts[:3] > 0)
    # Renormalised over survivors: 4/9, 3/9, 2/9.
    np.testing.assert_allclose(counts[:3] / 5000, [4 / 9, 3 / 9, 2 / 9], atol=0.03)


def test_min_p_one_is_argmax_on_big_vocab():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(V_BIG).astype(np.float32)
    assert _sampler(min_p=1.0).sample(logits) == int(np.argmax(logits))


# --- repetition penalty -------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_logits():
    # Token 0 leads by a little; penalising it (2.0 -> 1.0) hands greedy to token 1.
    logits = np.array([2.0, 1.5, 0.0], dtype=np.float32)
    s = _sampler(temperature=0.0, repetition_penalty=2.0)
    assert s.sample(logits, []) == 0
    assert s.sample(logits, [0]) == 1


def test_repetition_penalty_multiplies_negative_logits():
    # Both negative: -1.0 * 2 = -2.0 falls below -1.5, so the penalised token loses.
    logits = np.array([-1.0, -1.5, -9.0], dtype=np.float32)
    s = _sampler(temperature=0.0, repetition_penalty=2.0)
    assert s.sample(logits, [0]) == 1
    # A penalty < 1 rewards instead: -1.5 * 0.5 = -0.75 beats -1.0.
    assert _sampler(temperature=0.0, repetition_penalty=0.5).sample(logits, [1]) == 1


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_temperature_below_float32_range_is_greedy(temperature, top_p):
    """Found by tests/test_fuzz_requests.py: such a temperature is 0 in float32, and dividing the logits by
    it gave NaN weights (IndexError, or bincount's ValueError under top-p). Its limit is greedy."""
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1)
    assert params.temperature == 0.0
    assert Sampler(params).sample(logits, []) == int(np.argmax(logits))
    assert SamplingParams(temperature=1e-40).temperature == 1e-40  # a float32 subnormal: kept


@pytest.mark.parametrize("penalty", [5e-324, 1e-300])
def test_tiny_repetition_penalty_caps_instead_of_overflowing(penalty):
    """v / 1e-300 is inf in float32, which no softmax takes: capped at float32's max, the penalised
    positive logit wins, at any temperature, on the whole row and on the candidates alike."""
    logits = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    logits[7] = 0.5  # positive, not the argmax
    for temperature in (0.0, 0.8):
        s = _sampler(temperature=temperature, repetition_penalty=penalty, top_p=0.9)
        assert s.sample(logits, [7]) == 7
        ids = np.argsort(-logits)[:50]
        ids = np.append(ids, 7) if 7 not in ids else ids
        assert s.sample_candidates(ids, logits[ids], [7]) == 7


def test_repetition_penalty_only_looks_at_last_n_tokens():
    logits = np.array([2.0, 1.5, 0.0], dtype=np.float32)
    s = _sampler(temperature=0.0, repetition_penalty=2.0, repeat_last_n=3)
    assert s.sample(logits, [0, 2, 2, 2]) == 0  # token 0 is outside the window
    assert s.sample(logits, [2, 0, 2, 2]) == 1
    assert _sampler(temperature=0.0, repetition_penalty=2.0, repeat_last_n=0).sample(logits, [0]) == 0


def test_repetition_penalty_shifts_sampled_distribution():
    logits = np.full(3, 3.0, dtype=np.float32)
    n = 20_000
    counts = _draw_counts(_sampler(repetition_penalty=3.0), logits, n, recent=[0, 0, 0])
    expected = n * _softmax(np.array([1.0, 3.0, 3.0]))  # token 0: 3.0 / 3, once despite 3 repeats
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.4, (counts, expected)  # 2 dof: P(chi2 > 18.4) ~ 1e-4


# --- seeds --------------------------------------------------------------------------------------


def _generate(seed: int, steps: int = 32, **kw) -> list[int]:
    rng = np.random.default_rng(99)
    logits = [(rng.standard_normal(V_BIG) * 3).astype(np.float32) for _ in range(steps)]
    s = Sampler(SamplingParams(seed=seed, **kw))
    tokens: list[int] = []
    for row in logits:
        tokens.append(s.sample(row, tokens))
    return tokens


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8},
        {"top_p": 0.9, "repetition_penalty": 1.1},
    ],
)
def test_same_seed_same_tokens_different_seed_differs(kw):
    a, b, c = _generate(5, **kw), _generate(5, **kw), _generate(6, **kw)
    assert a == b
    assert a != c


def test_none_seed_draws_fresh_entropy_and_records_it():
    s1, s2 = Sampler(SamplingParams()), Sampler(SamplingParams())
    assert s1.seed != s2.seed
    replay = Sampler(SamplingParams(seed=s1.seed))
    logits = np.zeros(1000, dtype=np.float32)
    assert [s1.sample(logits) for _ in range(20)] == [replay.sample(logits) for _ in range(20)]


# --- edge cases ---------------------------------------------------------------------------------


def test_masked_tokens_are_never_drawn():
    logits = np.full(50, -np.inf, dtype=np.float32)
    logits[[3, 17]] = 0.0
    counts = _draw_counts(_sampler(), logits, 500)
    assert set(np.flatnonzero(counts)) == {3, 17}


def test_all_masked_logits_raise():
    with pytest.raises(ValueError, match="finite"):
        _sampler().sample(np.full(4, -np.inf, dtype=np.float32))


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError, match="1-D"):
        _sampler().sample(np.zeros((2, 3), dtype=np.float32))


# --- params -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": -0.1}, r"temperature must be a number in \[0, 100\], got -0.1"),
        ({"temperature": 100.5}, r"temperature must be a number in \[0, 100\], got 100.5"),  # as on the wire
        ({"temperature": float("nan")}, r"temperature must be a number in \[0, 100\]"),
        ({"top_k": -1}, "top_k must be an integer from 0 to 2\\^31-1, got -1"),
        ({"top_k": 2.5}, "top_k must be an integer from 0 to 2\\^31-1, got 2.5"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
        ({"min_p": -0.2}, r"min_p must be a number in \[0, 1\], got -0.2"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \(0, 100\], got 0.0"),
        ({"repeat_last_n": -1}, "repeat_last_n must be an integer from 0 to 1000000, got -1"),
        ({"seed": -3}, r"seed must be an integer from 0 to 2\^64-1, or null \(fresh entropy\), got -3"),
        ({"max_tokens": 0}, "max_tokens must be an integer from 1 to 1000000, got 0"),
        ({"max_tokens": True}, "max_tokens must be an integer from 1 to 1000000, got True"),
        ({"stop": ["ok", ""]}, "stop must be a list of at most 16 strings of 1 to 256 characters"),
        ({"stop": ["s"] * 17}, "stop must be a list of at most 16 strings"),
    ],
)
def test_validate_names_field_and_range(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).validate()


def test_defaults_are_valid_and_off():
    p = SamplingParams()
    p.validate()
    assert (p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.stop) == (0, 1.0, 0.0, 1.0, [])


def test_from_dict_builds_and_validates():
    p = SamplingParams.from_dict({"temperature": 0, "top_k": 40, "seed": 1, "stop": "\n\n"})
    assert p.temperature == 0 and p.top_k == 40 and p.seed == 1 and p.stop == ["\n\n"]
    assert SamplingParams.from_dict({"stop": ("a", "b")}).stop == ["a", "b"]
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 2"):
        SamplingParams.from_dict({"top_p": 2})


def test_from_dict_refuses_unknown_keys_by_name():
    with pytest.raises(ValueError, match="'top_q'.*'typo'"):
        SamplingParams.from_dict({"top_q": 0.5, "typo": 1, "top_k": 3})


def test_defaults_come_from_the_one_table():
    """SamplingParams() is a bare sampler: every knob at the table's "off" value, max_tokens its default."""
    p = SamplingParams()
    assert {f.name: getattr(p, f.name) for f in fields.FIELDS} == {**fields.OFF, "stop": []}
    assert p.max_tokens == fields.DEFAULTS["max_tokens"] == 512


EDGES = [None, True, False, -1, 0, 0.0, 0.5, 1, 1.0, 1.5, 2, 64, 100, 100.0, 100.5, 2**31 - 1, 2**31,
         10**6, 10**6 + 1, 2**64 - 1, 2**64, float("nan"), float("inf"), "1", [], ["a"], ["a", ""],
         ["x" * 256], ["x" * 257], ["s"] * 16, ["s"] * 17, ("a",)]  # fmt: skip


@pytest.mark.parametrize("f", fields.FIELDS, ids=lambda f: f.name)
def test_the_wire_check_and_the_engines_pydantic_model_agree(f):
    """The client's dependency-free check (hmaclient.sampling.allows) and the daemon's pydantic model are
    both built from the one table: on every edge they accept exactly the same values."""
    model = sampling_model("Check", fields.OFF)
    for value in EDGES:
        try:
            model.model_validate({f.name: value})
            accepted = True
        except ValidationError:
            accepted = False
        if isinstance(value, tuple):
            accepted = f.kind == "strings"  # msgpack and YAML give lists; a tuple is the Python caller's
        assert fields.allows(f, value) == accepted, (f.name, value)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=7), backend="cpu")


def test_validate_runs_once_per_generation(monkeypatch, tiny_model):
    """generate() validates each request's params once; the Sampler trusts them (it used to check again)."""
    calls = []
    real = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: (calls.append(self), real(self))[1])
    generate(tiny_model, ["a", "b"], SamplingParams(temperature=0, max_tokens=2))
    assert len(calls) == 2


# --- candidates (the GPU top-k path) ----------------------------------------------------------------------
def best_m(logits: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """What shaders/topk.comp returns: the m best (value desc, equal values lowest id first; NaN as -inf)."""
    key = np.where(np.isnan(logits), -np.inf, logits)
    order = np.lexsort((np.arange(logits.size), -key))[:m]
    return order, logits[order]


@pytest.mark.parametrize("trial", range(40))
def test_candidates_give_the_same_token_as_the_whole_row(trial):
    """Fresh random rows with ties at the top-k boundary, -inf and NaN entries, penalised recent tokens
    among the best: sample_candidates on the best candidates_needed() (+ a random surplus) picks what
    sample picks from the whole row, step after step with one seed (both draw the same randoms)."""
    rng = np.random.default_rng()
    v = 5000
    params = dict(
        temperature=float(rng.choice([0.0, 0.7, 1.0, 1.5])),
        top_k=int(rng.integers(1, 80)),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.05])),
        repetition_penalty=float(rng.choice([1.0, 1.3])),
        repeat_last_n=int(rng.choice([0, 8, 64])),
    )
    full, cand = _sampler(seed=trial, **params), _sampler(seed=trial, **params)
    history = list(map(int, rng.integers(0, v, 20)))
    for _ in range(8):
        logits = (rng.standard_normal(v) * 3).astype(np.float32)
        logits[rng.integers(0, v, 30)] = np.float32(7.5)  # a block of ties near the top
        logits[rng.integers(0, v, 5)] = -np.inf
        logits[rng.integers(0, v, 2)] = np.nan
        history += list(map(int, best_m(logits, 5)[0]))  # penalise some of the best
        need = cand.candidates_needed(history)
        assert need is not None
        ids, vals = best_m(logits, need + int(rng.integers(0, 5)))
        perm = rng.permutation(ids.size)  # any order
        want = full.sample(np.where(np.isnan(logits), np.float32(-np.inf), logits), history)
        got = cand.sample_candidates(ids[perm], vals[perm], history)
        assert got == want, params
        history.append(want)


def test_candidates_needed_is_none_when_the_whole_row_matters():
    assert _sampler(top_k=0, temperature=1.0).candidates_needed([1, 2]) is None  # top-k off
    assert _sampler(top_k=5, repetition_penalty=0.8).candidates_needed([1, 2, 2]) is None  # raises logits
    assert _sampler(top_k=5, repetition_penalty=1.2).candidates_needed([1, 2, 2]) == 5 + 2
    assert _sampler(temperature=0.0, top_k=0).candidates_needed([]) == 1
