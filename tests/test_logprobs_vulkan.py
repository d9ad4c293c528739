"""Logprobs on the Vulkan backend (lavapipe in CI) against the numpy backend: the same requests (greedy and
sampled, one alone and several in a step beside requests without logprobs) give the same tokens and the
same logprobs within a tolerance, since the rows come from different backends. Needs a Vulkan device."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from test_model_cpu import rand_ids
from tiny_gguf import make_tiny_gguf
from vk_harness import open_device

from hmad.composition import load_model
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu

# relative to the value: the backends' logits of the tiny model reach ~100 and differ in their last bits
TOL = 1e-4
CFG = SchedulerConfig(max_seqs=4, step_tokens=24, max_chunk=16, kv_tokens=1024, prefix_cache=False)
_ids = itertools.count()


@pytest.fixture(scope="module")
def scheds(tmp_path_factory):
    with open_device():  # or a skip that says why
        pass
    path = make_tiny_gguf(tmp_path_factory.mktemp("lp") / "tiny.gguf", seed=3)
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan")
    yield Scheduler(cpu, CFG), Scheduler(vk, CFG), path
    vk.backend.close()


def _run(sched: Scheduler, prompts, params: list[SamplingParams]) -> list[tuple[list[int], list[dict]]]:
    """Each request's (token ids, logprobs entries), driving ``sched`` as the engine does."""
    out = {}
    for ids, p in zip(prompts, params, strict=True):
        p.validate()
        rid = next(_ids)
        sched.submit(Request(rid, list(ids), dataclasses.replace(p)))
        out[rid] = ([], [])
    while sched.has_work():
        for ev in sched.step():
            if ev.kind == "token":
                out[ev.request_id][0].extend(ev.token_ids)
                out[ev.request_id][1].extend(ev.logprobs or [])
    return list(out.values())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def test_vulkan_logprobs_equal_numpys(scheds):
    import numpy as np

    cpu, vk, _ = scheds
    rng = np.random.default_rng(0)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, n, vocab) for n in (5, 9, 3)]
    bias = {int(t): 100.0 for t in rng.integers(4, vocab, 3)}  # a real distribution (the model is peaked)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=5, logit_bias=bias),
        SamplingParams(temperature=0.8, top_k=8, seed=7, max_tokens=5, logprobs=2, logit_bias=bias),
        SamplingParams(temperature=0.0, max_tokens=5),  # none asked, in the same steps
    ]
    for mine, ref in zip(_run(vk, prompts, params), _run(cpu, prompts, params), strict=True):
        assert mine[0] == ref[0]
        assert len(mine[1]) == len(ref[1])
        for a, b in zip(mine[1], ref[1], strict=True):
            assert a["token_id"] == b["token_id"] and _close(a["logprob"], b["logprob"]), (a, b)
            assert [i for i, _, _ in a["top"]] == [i for i, _, _ in b["top"]]
            assert all(_close(x[1], y[1]) for x, y in zip(a["top"], b["top"], strict=True))
    assert [len(e) for _, e in _run(vk, prompts[:1], params[:1])] == [5]  # alone: the same count


def test_vulkan_prompt_logprobs_over_chunks_equal_numpys_and_the_whole_pass(scheds):
    """A 40-token prompt in chunks of 16 beside another request: every prompt token's entry on both backends
    equals the log-softmax of one pass over the whole prompt (forward_full) at the position before it."""
    import numpy as np

    from hmad.engine.generate import forward_full

    cpu, vk, path = scheds
    rng = np.random.default_rng(2)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, 40, vocab), rand_ids(rng, 7, vocab)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    got = {}
    for name, sched in (("vk", vk), ("cpu", cpu)):
        for p in params:
            p.validate()
        pairs = zip(prompts, params, strict=True)
        reqs = [Request(next(_ids), list(ids), dataclasses.replace(p)) for ids, p in pairs]
        for r in reqs:
            sched.submit(r)
        while sched.has_work():
            sched.step()
        got[name] = reqs[0].prompt_logprobs
        assert reqs[1].prompt_logprobs is None
    model = load_model(path, "cpu", numerics="f32")  # (forward_full makes its own KV pools)
    logits = forward_full(model, list(prompts[0])).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for name, entries in got.items():
        assert len(entries) == 40 and entries[0] is None, name
        for i, e in enumerate(entries[1:], start=1):
            assert e["token_id"] == prompts[0][i] and _close(e["logprob"], ref[i - 1, prompts[0][i]]), (
                name,
                i,
            )
            assert all(_close(lp, ref[i - 1, t]) for t, lp, _ in e["top"])
