"""Speculative decoding on the Vulkan backend (lavapipe in CI): greedy answers identical with and without
prompt lookup in deterministic mode, drafts both kept and rolled back, every KV block given back; without
it, every greedy token the argmax of its teacher-forced logits
(tests/test_speculation.py has the rest, on numpy). Kept small: lavapipe runs a step in a fraction of a
second on 2 cores, and a step of drafts records a bucket of its own the first time."""

from __future__ import annotations

import dataclasses

import pytest
from test_speculation import GREEDY, LOOKUP, assert_teacher_forced, both, prompts, requests, run
from tiny_gguf import MIXED, make_tiny_gguf
from vk_harness import require_vulkan

from hmad.composition import load_model
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.speculation import SpeculationConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    require_vulkan()
    path = make_tiny_gguf(tmp_path_factory.mktemp("vkspec") / "tiny.gguf", seed=7, types=MIXED)
    model = load_model(path, "vulkan", deterministic=True)
    yield model
    model.backend.close()


def test_greedy_identical_with_and_without_speculation(tiny, monkeypatch):
    """Deterministic mode: the same logits row by row whether a step holds one token of a sequence or its
    token and drafts, so the same argmax (the plain run's on the device, pipelined; the speculating run's
    on the device too, a pick per row: no whole row comes to the host); the rejected drafts' KV positions
    are written again."""
    params = dataclasses.replace(GREEDY, max_tokens=12)
    whole = []
    monkeypatch.setattr(tiny, "forward", lambda batch, f=tiny.forward: whole.append(batch) or f(batch))
    off, on, st = both(tiny, lambda: requests(prompts(2), params), max_seqs=2)  # (both: no block held after)
    assert on == off
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st
    assert not whole, f"{len(whole)} steps read whole rows"


def test_plain_mode_teacher_forced(tmp_path):
    """Without deterministic mode a step of drafts runs other kernels than a step of one token (as
    batches do): every greedy token of a speculating run is the argmax of its sequence's logits computed
    in one pass on the same device (teacher forced), or within 1e-4 of the row's scale of it."""
    require_vulkan()
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=7, types=MIXED)
    model = load_model(path, "vulkan", deterministic=False)
    try:
        ps = prompts(4)
        events, sched = run(model, requests(ps, GREEDY), LOOKUP)
        st = sched.status()["speculation"]
        assert st["accepted"] > 0 and st["rolled_back"] > 0, st
        assert_teacher_forced(model, events, ps)
    finally:
        model.backend.close()


def test_from_pipelined_steps_to_speculating_ones(tiny):
    """3 sequences, speculation up to 2: the steps are pipelined until one ends, then speculate."""
    params = dataclasses.replace(GREEDY, max_tokens=8)

    def make():
        reqs = requests(prompts(3), params)
        reqs[2].params.max_tokens = 1
        return reqs

    off, on, st = both(tiny, make, SpeculationConfig(mode="lookup", max_batch=2), max_seqs=3)
    assert on == off
    assert st["accepted"] > 0, st


def test_sampled_identical_for_a_seed(tiny):
    """Sampled requests: without speculation the device draws each token from its top-k (pipelined, the
    host drawing again from the same candidates); speculating, the host draws from whole rows. One
    uniform per token either way: the same tokens for a seed."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=10)

    def make():
        return [Request(i, p, dataclasses.replace(params, seed=10 + i)) for i, p in enumerate(prompts(2))]

    off, on, st = both(tiny, make, max_seqs=2)
    assert on == off
    assert st["accepted"] > 0, st
