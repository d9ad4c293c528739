"""engine/draw_rows.py: a step's candidate rows drawn at once give, row for row, the token and the uniforms of
``Sampler.sample_candidates`` (the reference: what a step run alone draws), on fresh random rows and settings.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hmad.engine.draw_rows import _inverse_cdf_rows, draw_rows
from hmad.engine.sampling import Sampler, SamplingParams, _draw

V = 262144  # Gemma 3's vocabulary: candidate ids are drawn from it
M = 128  # the Vulkan backend's candidates a row


def _params(rng: np.random.Generator) -> SamplingParams:
    temperature = float(rng.choice([0.0, 1.0, 0.7, rng.uniform(0.01, 5.0), 1e-3, 50.0]))
    return SamplingParams(
        temperature=temperature,
        top_k=int(rng.choice([64, 40, 1, 2, 7, 128, 200, 0, rng.integers(1, M + 1)])),
        top_p=float(rng.choice([0.95, 1.0, 0.5, rng.uniform(0.01, 1.0), 1e-6, 0.999999])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, rng.uniform(0.0, 1.0), 1.0])),
        seed=int(rng.integers(2**63)),
    )


def _values(rng: np.random.Generator, kind: str, m: int = M) -> np.ndarray:
    v = {
        "normal": lambda: rng.standard_normal(m) * 3,
        "wide": lambda: rng.standard_normal(m) * 100,
        "narrow": lambda: rng.standard_normal(m) * 0.01,
        "rounded": lambda: np.round(rng.standard_normal(m) * 2, 1),  # many equal logits
        "flat": lambda: np.full(m, rng.standard_normal()),
    }[kind]()
    return v.astype(np.float32)


def _candidates(rng: np.random.Generator, kinds: list[str], m: int = M) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(V, m, replace=False) for _ in kinds])
    return ids, np.stack([_values(rng, k, m) for k in kinds])


def _twins(params: list[SamplingParams], rng: np.random.Generator) -> tuple[list[Sampler], list[Sampler]]:
    """Two samplers per setting, in the same state; some with uniforms already drawn ahead (``upcoming``, as
    a pipelined step does)."""
    a = [Sampler(copy.deepcopy(p)) for p in params]
    b = [Sampler(copy.deepcopy(p)) for p in params]
    for x, y in zip(a, b, strict=True):
        for n in range(int(rng.integers(0, 3))):
            assert x.upcoming(n) == y.upcoming(n)
    return a, b


def _check(
    got: list[int | None], a: list[Sampler], b: list[Sampler], ids: np.ndarray, vals: np.ndarray
) -> int:
    """Every row's token equals the reference's, and both samplers are left in the same state (the same
    uniforms used); rows draw_rows left (None) are drawn one by one first. Returns how many it took."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        want = y.sample_candidates(ids[i], vals[i])
        tok = x.sample_candidates(ids[i], vals[i]) if got[i] is None else got[i]
        assert tok == want, (i, x.params)
        assert list(x._ahead) == list(y._ahead) and x.rng.random() == y.rng.random(), (i, x.params)
    return sum(t is not None for t in got)


def test_rows_drawn_together_are_the_rows_drawn_one_by_one():
    """Fresh random rows (normal, wide, narrow, rounded with many ties, flat) and settings (greedy, top-k 1 to
    past M, top-p and min-p at their edges, temperatures 1e-3 to 50), 1 to 40 rows a step."""
    rng = np.random.default_rng()
    kinds = ["normal", "wide", "narrow", "rounded", "flat"]
    taken = rows = 0
    for _ in range(300):
        n = int(rng.integers(1, 41))
        ids, vals = _candidates(rng, [str(rng.choice(kinds)) for _ in range(n)])
        params = [_params(rng) for _ in range(n)]
        a, b = _twins(params, rng)
        taken += _check(draw_rows(a, ids, vals), a, b, ids, vals)
        rows += n
    assert taken > 0.8 * rows, (taken, rows)  # only boundary-bucket ties (rounded rows) go one by one


def test_gemma_defaults_are_all_taken():
    """The default settings on rows without ties: every row is drawn together, the same tokens."""
    rng = np.random.default_rng()
    ids, vals = _candidates(rng, ["normal"] * 32)
    params = [
        SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=int(rng.integers(2**63))) for _ in ids
    ]
    a, b = _twins(params, rng)
    assert _check(draw_rows(a, ids, vals), a, b, ids, vals) == 32


@pytest.mark.parametrize("m", [1, 3, 64, 128])
def test_candidate_counts(m):
    """Fewer candidates than top-k keeps them all; one candidate is always drawn."""
    rng = np.random.default_rng()
    ids, vals = _candidates(rng, ["normal"] * 8, m)
    params = [_params(rng) for _ in ids]
    a, b = _twins(params, rng)
    _check(draw_rows(a, ids, vals), a, b, ids, vals)


def test_rows_it_leaves_keep_their_uniforms():
    """A repetition penalty, a non-finite candidate, an id given twice, more than 128 candidates: None, and
    the row's sampler has drawn nothing (its next draw is the reference's)."""
    rng = np.random.default_rng()
    ids, vals = _candidates(rng, ["normal"] * 4)
    params = [SamplingParams(top_k=64, top_p=0.9, seed=int(rng.integers(2**63))) for _ in range(4)]
    params[0].repetition_penalty = 1.3
    vals[1, 5] = np.nan
    vals[2, 7] = -np.inf
    ids[3, 9] = ids[3, 10]
    a, b = _twins(params, rng)
    assert draw_rows(a, ids, vals) == [None] * 4
    _check([None] * 4, a, b, ids, vals)
    wide_ids, wide_vals = _candidates(rng, ["normal"] * 3, 129)
    a, b = _twins([SamplingParams(top_k=64, seed=s) for s in (1, 2, 3)], rng)
    assert draw_rows(a, wide_ids, wide_vals) == [None] * 3
    _check([None] * 3, a, b, wide_ids, wide_vals)


def test_inverse_cdf_at_the_cdf_s_edges():
    """The draw's last stage against ``sampling._draw`` with uniforms placed on each entry's CDF boundary
    and the next doubles either side (where a total summed in another order would move the pick): weights
    of mixed magnitudes, n kept of a group's k columns (top-k), 1 <= n <= k <= 128."""
    rng = np.random.default_rng()
    for _ in range(60):
        k = int(rng.integers(1, M + 1))
        n = int(rng.integers(1, k + 1))
        w = np.zeros(k, np.float32)
        w[:n] = (rng.random(n) * 10.0 ** rng.integers(-40, 1, n)).astype(np.float32)  # float64 sums round
        w[rng.integers(n)] = 1.0
        total = np.zeros(1024, np.float32)
        total[:n] = w[:n]
        s = total.sum(dtype=np.float64)
        edges = np.cumsum(w[:n], dtype=np.float64) / s
        u01 = [u for e in edges for u in (np.nextafter(e, 0), e, np.nextafter(e, 1)) if 0 <= u < 1]
        got = _inverse_cdf_rows(np.tile(w, (len(u01), 1)), np.array(u01))
        assert got.tolist() == [_draw(w[:n], u) for u in u01]


def test_min_p_compares_in_float32():
    """min_p is compared with float32 weights as numpy compares a float32 array with a Python float: a min_p a
    hair above a weight, equal to it in float32, keeps that token (as the per-row path does)."""
    rng = np.random.default_rng()
    vals = np.array([[0.0, -0.7, -5.0, -6.0]], np.float32)
    w = np.exp(vals[0] - vals[0].max())  # the sampler's weights at temperature 1
    min_p = float(w[1]) + float(np.spacing(w[1])) / 4
    assert np.float32(min_p) == w[1] and min_p > float(w[1])
    ids = np.array([[11, 22, 33, 44]])
    for _ in range(40):
        seed = int(rng.integers(2**63))
        a, b = _twins([SamplingParams(top_k=4, min_p=min_p, seed=seed)], rng)
        _check(draw_rows(a, ids, vals), a, b, ids, vals)
