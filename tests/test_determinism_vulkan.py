"""Batch invariance on the Vulkan backend (deterministic=True; issue 16, docs/determinism.md).

The same checks as test_determinism.py: random mixes of sequences on tiny random models (logits bit-identical
to each sequence's solo run), the fidelity prompts' greedy continuations solo, together and through a real
daemon under 8 concurrent clients, and seeded sampling requests through a daemon (pipelined steps that draw on
the GPU) beside greedy ones. Marked ``gpu``: lavapipe in CI, a GPU through the device tool (with
HMAD_TEST_MODEL for the 270M). Lavapipe runs a tiny model's step in ~0.25 s on 2 cores (a mix of 5
sequences of up to 120 tokens took 4 minutes per model on this shared machine), so there the mixes hold 4
sequences of up to 64 tokens on two of the three models, and the 270M checks take the 4 shortest prompts with
8 tokens; a GPU gets 1 to 32 sequences of up to 120 tokens on all three and all 12 prompts with 16 tokens.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from daemon_harness import Daemon
from determinism_harness import first_mismatch, mixed_schedule, rand_ids, run_schedule, solo_logits
from test_determinism import ALL, CASES, N_NEW, check_daemon, greedy_solo, greedy_together
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmad.composition import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def vulkan_device():
    try:
        from hmad.backends.vulkan import device as vkdev

        with vkdev.Device() as d:
            return d.info.is_cpu
    except Exception as e:  # no loader, no driver, unsuitable device
        pytest.skip(f"no usable Vulkan device ({e}); apt-get install mesa-vulkan-drivers provides lavapipe")


@pytest.fixture(scope="module", params=["mixed-exact", "mixed-int8", "f32-float"])
def tiny(request, tmp_path_factory):
    """The default int8-planes mat-vec on quantized weights, its one-plane variant, and the float path."""
    types = MIXED if request.param.startswith("mixed") else None
    path = make_tiny_gguf(tmp_path_factory.mktemp("vkdet") / "tiny.gguf", seed=5, types=types)
    matvec = request.param.split("-")[1]
    model = load_model(path, "vulkan", deterministic=True, matvec=matvec)
    yield model
    model.backend.close()


def test_random_mixes_bit_identical_to_solo(tiny, vulkan_device):
    if vulkan_device and tiny.backend.matvec == "int8":
        pytest.skip("on a CPU implementation (CI time): the int8 one-plane mat-vec runs on a GPU")
    rng = np.random.default_rng(0)
    vocab = tiny.config.vocab_size
    n, longest = (4, 64) if vulkan_device else (int(rng.integers(1, 33)), 120)
    # chunks up to 48 rows: steps of more than 32 tokens, which the plain mode runs on the mat-mat
    seqs = [rand_ids(rng, int(rng.integers(1, longest + 1)), vocab) for _ in range(n)]
    solo = solo_logits(tiny, rng, seqs, max_chunk=48)
    mixed = run_schedule(tiny, seqs, mixed_schedule(rng, list(map(len, seqs)), 48), max_chunk=48)
    bad = {i: m for i, (a, b) in enumerate(zip(mixed, solo, strict=True)) if (m := first_mismatch(a, b))}
    assert not bad, f"{len(bad)} of {len(seqs)} sequences differ from their solo run: {bad}"


@pytest.fixture(scope="module")
def embedded(embedded_model_path):
    model = load_model(embedded_model_path, "vulkan", deterministic=True)
    yield model
    model.backend.close()


@pytest.fixture(scope="module")
def subset(embedded):
    """(prompt indices, new tokens): the 4 shortest prompts x 8 on a CPU implementation, else all x 16."""
    if embedded.backend.dev.info.is_cpu:
        return sorted(ALL, key=lambda i: len(CASES[i]["prompt_ids"]))[:4], 8
    return ALL, N_NEW


@pytest.fixture(scope="module")
def solo_ids(embedded, subset):
    return greedy_solo(embedded, *subset)


@pytest.mark.slow
@pytest.mark.xdist_group("vulkan-270m-deterministic")  # one worker, one solo_ids
@pytest.mark.timeout(2400)
def test_fidelity_prompts_greedy_identical_solo_and_together(embedded, subset, solo_ids):
    together = greedy_together(embedded, *subset)
    differ = [i for i, a, b in zip(subset[0], together, solo_ids, strict=True) if a != b]
    assert not differ, f"prompts {differ} differ between solo and together"


@pytest.mark.slow
@pytest.mark.xdist_group("vulkan-270m-deterministic")  # one worker, one solo_ids
@pytest.mark.timeout(2400)
def test_fidelity_prompts_identical_through_daemon_under_8_clients(
    embedded_model_path, tmp_path, subset, solo_ids
):
    check_daemon(embedded_model_path, tmp_path, "vulkan", *subset, solo_ids)


def test_sampled_requests_through_daemon_get_their_solo_tokens(tmp_path):
    """Seeded sampling requests (hot: the tiny model's top logit is ~90 above the rest) beside greedy ones,
    sent together to a real hmad on Vulkan: each gets the tokens it gets alone, through pipelined steps that
    draw on the GPU (engine.pipeline; the host checks every draw: status draws_corrected)."""
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=5, types=MIXED)
    hot = dict(temperature=50.0, top_k=64, top_p=0.95)
    reqs = [
        ("the cat sat", dict(hot, seed=1)),
        ("a b c d e", dict(temperature=0.0)),
        ("x y", dict(hot, seed=2, min_p=0.05)),
        ("the dog ran far", dict(temperature=30.0, top_k=5, seed=3)),
    ]
    d = Daemon(path, tmp_path, "engine.deterministic=true", "engine.max_seqs=4", backend="vulkan")
    try:
        d.wait_ready(timeout=600)
        with Client(d.socket, timeout=300) as c:
            alone = [c.generate(p, raw=True, max_tokens=12, stop=[], **kw).token_ids for p, kw in reqs]
        together: dict[int, list[int]] = {}

        def send(i: int) -> None:
            with Client(d.socket, timeout=300) as c:
                together[i] = c.generate(reqs[i][0], raw=True, max_tokens=12, stop=[], **reqs[i][1]).token_ids

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with Client(d.socket, timeout=30) as c:
            st = c.status()
    finally:
        assert d.stop() == 0, d.log_text()
    assert [together.get(i) for i in range(len(reqs))] == alone
    assert len({t for i in (0, 2, 3) for t in alone[i]}) > 6  # the draws drew more than the argmax
    assert st["pipelined_steps"] > 20 and "draws_corrected" in st
