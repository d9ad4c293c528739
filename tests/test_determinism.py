"""Batch invariance on the numpy backend (engine.deterministic; issue 16, docs/determinism.md).

With ``deterministic=True`` a sequence's logits are bit-identical (np.array_equal, not allclose) whether it
runs alone or among others: random mixes of 1 to 32 sequences, prefill chunks of random sizes beside
one-row (decode) steps, random places in the batch, and a random chunking of each sequence's own prompt in
its solo run. Then greedy generation gives the same tokens solo, all together and through a real daemon
under 8 concurrent clients (the 12 fidelity prompts of tests/fixtures/llamacpp_greedy.json, 16 tokens).
The plain mode is checked to differ, so that the mixes do reach the row-count-dependent BLAS paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon, run_in_threads
from determinism_harness import first_mismatch, mixed_schedule, rand_ids, run_schedule, solo_logits
from gguf import GGMLQuantizationType as Q
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.backends import invariant
from hmad.backends.cpu import CpuBackend
from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import SchedulerConfig

CASES = json.loads((Path(__file__).parent / "fixtures" / "llamacpp_greedy.json").read_text())["cases"]
N_NEW = 16
#: weight presets of the tiny models: float32; the 270M's mix (Q5_0, Q8_0, Q4_K, Q4_0, Q6_K); float16
PRESETS = {
    "f32": None,
    "mixed": MIXED,
    "f16": dict.fromkeys(MIXED, Q.F16),
}


@pytest.fixture(scope="module", params=[(p, n) for p in PRESETS for n in ("ggml", "f32")], ids=str)
def tiny(request, tmp_path_factory):
    preset, numerics = request.param
    path = make_tiny_gguf(tmp_path_factory.mktemp("det") / f"{preset}.gguf", seed=5, types=PRESETS[preset])
    return load_model(path, backend="cpu", numerics=numerics, deterministic=True)


def random_seqs(rng, vocab: int) -> list[list[int]]:
    """1 to 32 sequences of 1 to 48 tokens (the tiny models' window is 8: local layers wrap their ring)."""
    return [rand_ids(rng, int(rng.integers(1, 49)), vocab) for _ in range(int(rng.integers(1, 33)))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mixes_bit_identical_to_solo(tiny, seed):
    rng = np.random.default_rng(seed)
    seqs = random_seqs(rng, tiny.config.vocab_size)
    solo = solo_logits(tiny, rng, seqs, max_chunk=24)
    mixed = run_schedule(tiny, seqs, mixed_schedule(rng, list(map(len, seqs)), 24), max_chunk=24)
    bad = {i: m for i, (a, b) in enumerate(zip(mixed, solo, strict=True)) if (m := first_mismatch(a, b))}
    assert not bad, f"{len(bad)} of {len(seqs)} sequences differ from their solo run: {bad}"


def test_plain_mode_differs_so_the_mixes_reach_batch_dependent_paths(tmp_path):
    """Without deterministic mode the same kind of mix does change logits (OpenBLAS: sgemv for one row,
    sgemm for more), so the test above would catch a backend that lost its invariance."""
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=5, types=MIXED)
    model = load_model(path, backend="cpu", deterministic=False)
    rng = np.random.default_rng(0)
    seqs = [rand_ids(rng, n, model.config.vocab_size) for n in (30, 17, 9, 40)]
    solo = solo_logits(model, rng, seqs, max_chunk=24)
    mixed = run_schedule(model, seqs, mixed_schedule(rng, list(map(len, seqs)), 24), max_chunk=24)
    assert any(first_mismatch(a, b) for a, b in zip(mixed, solo, strict=True))


@pytest.mark.parametrize("k,n", [(256, 512), (640, 1024), (2048, 640), (640, 9000)])
def test_matmul_row_independent_of_batch(k, n):
    """invariant.matmul: a row's result is the same alone, at any place among 1..40 rows, with any others
    (the large N walks the weight in chunks); and it is x @ wᵀ to float32 rounding."""
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    row = rng.standard_normal(k).astype(np.float32)
    alone = invariant.matmul(row[None], w)[0]
    np.testing.assert_allclose(alone, w.astype(np.float64) @ row, rtol=1e-4, atol=1e-3)
    for m in (2, 7, 8, 9, 16, 33, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        p = int(rng.integers(m))
        x[p] = row
        assert np.array_equal(invariant.matmul(x, w)[p], alone), (m, p)


# -- the embedded 270M: greedy continuations solo, together, through the daemon ----------------------------
ALL = list(range(len(CASES)))


def prompt_ids(model, i: int) -> list[int]:
    """Fidelity prompt ``i`` as the daemon tokenizes it (raw): for the embedded model, llama.cpp's ids in the
    fixture (test_tokenizer checks they agree); any other model (a GPU run's stand-in) gets its own."""
    return model.tokenizer.encode(CASES[i]["prompt"])


def greedy_solo(model, idx: list[int], n_new: int) -> list[list[int]]:
    """Greedy continuations of the fidelity prompts ``idx``, each generated alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, stop=[])
    return [generate(model, [prompt_ids(model, i)], greedy)[0].token_ids for i in idx]


def greedy_together(model, idx: list[int], n_new: int) -> list[list[int]]:
    """The same prompts in one scheduler: 64-token prefill chunks beside decode rows, 256 tokens a step."""
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, stop=[])
    cfg = SchedulerConfig(max_seqs=len(idx), step_tokens=256, max_chunk=64, kv_tokens=4096)
    return [r.token_ids for r in generate(model, [prompt_ids(model, i) for i in idx], greedy, cfg)]


@pytest.fixture(scope="module")
def embedded(embedded_model_path):
    return load_model(embedded_model_path, backend="cpu", deterministic=True)


@pytest.fixture(scope="module")
def solo_ids(embedded):
    return greedy_solo(embedded, ALL, N_NEW)


@pytest.mark.slow
@pytest.mark.xdist_group("cpu-270m-deterministic")  # one worker, one solo_ids
@pytest.mark.timeout(2400)  # the 968-token prompt prefills a mat-vec per row
def test_fidelity_prompts_greedy_identical_solo_and_together(embedded, solo_ids):
    together = greedy_together(embedded, ALL, N_NEW)
    differ = [i for i, (a, b) in enumerate(zip(together, solo_ids, strict=True)) if a != b]
    assert not differ, f"prompts {differ} differ between solo and together"


def query_all(socket: str, idx: list[int], n_new: int, clients: int) -> list[list[int]]:
    """The fidelity prompts ``idx`` through the daemon, ``clients`` threads each sending its share at once."""
    from hmaclient import Client

    out: dict[int, list[int]] = {}

    def run(share: list[int]) -> None:
        with Client(socket, timeout=600) as c:
            for i in share:
                r = c.generate(CASES[i]["prompt"], raw=True, max_tokens=n_new, temperature=0.0, stop=[])
                out[i] = r.token_ids

    run_in_threads(run, [(idx[j::clients],) for j in range(clients)])
    return [out[i] for i in idx]


def check_daemon(model_path, tmp_path, backend: str, idx: list[int], n_new: int, solo_ids: list) -> None:
    """A real hmad in deterministic mode: status says so, and the prompts sent by 8 concurrent clients get
    the continuations ``solo_ids`` (each prompt generated alone, in this process)."""
    d = Daemon(model_path, tmp_path, "engine.deterministic=true", "engine.max_seqs=8", backend=backend)
    try:
        d.wait_ready(timeout=600)
        from hmaclient import Client

        with Client(d.socket, timeout=30) as c:
            assert c.status()["deterministic"] is True
        eight = query_all(d.socket, idx, n_new, clients=8)
        with Client(
            d.socket, timeout=30
        ) as c:  # greedy requests on the GPU: pipelined steps (engine.pipeline)
            st = c.status()
        assert 0 < st["pipelined_steps"] < st["steps"] if backend == "vulkan" else st["pipelined_steps"] == 0
    finally:
        assert d.stop() == 0, d.log_text()
    differ = [i for i, a, b in zip(idx, eight, solo_ids, strict=True) if a != b]
    assert not differ, f"prompts {differ} differ between alone and among 8 concurrent clients"


@pytest.mark.slow
@pytest.mark.xdist_group("cpu-270m-deterministic")  # one worker, one solo_ids
@pytest.mark.timeout(2400)
def test_fidelity_prompts_identical_through_daemon_under_8_clients(embedded_model_path, tmp_path, solo_ids):
    check_daemon(embedded_model_path, tmp_path, "cpu", ALL, N_NEW, solo_ids)


def test_status_shows_the_default_mode(tmp_path):
    """engine.deterministic auto: the cpu backend's own default (CpuBackend.deterministic_auto)."""
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=5)
    d = Daemon(path, tmp_path, backend="cpu").wait_ready()
    try:
        from hmaclient import Client

        with Client(d.socket, timeout=30) as c:
            assert c.status()["deterministic"] is CpuBackend.deterministic_auto
    finally:
        assert d.stop() == 0, d.log_text()
