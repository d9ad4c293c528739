"""Where a step's tokens are picked (engine/planning.py): a request with logprobs is served from the device's
top-k candidates and row log-sum-exps when they can give its token and its alternatives (no grammar, no
repetition penalty, no prompt rows, at most ``topk_max`` candidates), else from whole rows; it never takes
the device's argmax and is never pipelined. No device: a stand-in model with the backend's flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hmad.engine.planning import StepPlanner, candidates_needed, greedy_ok, needs_row
from hmad.engine.request import Request, State
from hmad.engine.sampling import Sampler, SamplingParams

TOPK_MAX = 128


def _req(state: State = State.DECODE, grammar: bool = False, **params) -> Request:
    p = SamplingParams(**{"max_tokens": 8, **params})
    p.validate()
    r = Request(0, [5, 6, 7, 6], p, state=state)
    r.sampler = Sampler(p)
    r.grammar_state = object() if grammar else None  # a grammar's state: it masks the row
    return r


def _planner(topk_max: int = TOPK_MAX) -> StepPlanner:
    be = SimpleNamespace(
        topk_max=topk_max,
        bias_max=64,
        pipelined=True,
        sample_on_device=True,
        greedy_on_device=True,
    )
    model = SimpleNamespace(backend=be, config=SimpleNamespace(vocab_size=1000))
    return StepPlanner(model, kv=None, step_tokens=64, max_chunk=16, context=4096)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 0.0, "logprobs": 0},
        {"temperature": 0.8, "top_k": 40, "logprobs": 20, "logit_bias": {3: 5.0}},
        {"temperature": 0.8, "top_k": 40, "logprobs": 20, "presence_penalty": 0.5},
        {"temperature": 0.0, "logprobs": 20},  # the most the wire takes
    ],
)
def test_logprobs_that_the_candidates_give_take_the_topk_path(params):
    r, plan = _req(**params), _planner()
    assert not needs_row(r, TOPK_MAX) and not greedy_ok(r)
    assert not plan.greedy_on_device([r]) and plan.topk_on_device([r])
    assert not plan.can_pipeline([r], True)  # the sample tail reads back no log-sum-exp
    assert candidates_needed(r) == max(1 if r.params.temperature == 0 else 40, params["logprobs"], 1)


@pytest.mark.parametrize(
    "kw",
    [
        {"grammar": True, "temperature": 0.0, "logprobs": 2},  # the grammar's mask is host-side
        {"temperature": 0.0, "logprobs": 2, "repetition_penalty": 1.3},  # the lse is of the row before it
        {"temperature": 0.8, "top_k": 0, "logprobs": 2},  # top-k off: the draw needs the whole row
        {"temperature": 0.8, "top_k": 100, "logprobs": 2, "repetition_penalty": 1.2},  # 100 + penalized
        {"state": State.PREFILL, "temperature": 0.0, "prompt_logprobs": 1},  # prompt rows stay whole
    ],
)
def test_logprobs_or_rows_the_candidates_cannot_give_read_whole_rows(kw):
    r, plan = _req(**kw), _planner()
    assert needs_row(r, TOPK_MAX)
    assert not plan.greedy_on_device([r]) and not plan.topk_on_device([r])
    assert not plan.can_pipeline([r], True)


def test_more_alternatives_than_the_backend_gives_read_whole_rows():
    r = _req(temperature=0.0, logprobs=20)
    assert needs_row(r, 16) and not needs_row(r, 20)
    assert not _planner(16).topk_on_device([r]) and _planner(20).topk_on_device([r])
    assert needs_row(r) and not _planner(0).topk_on_device([r])  # a backend without a top-k


def test_requests_without_logprobs_keep_their_paths():
    greedy, sampled = _req(temperature=0.0), _req(temperature=0.8, top_k=40, seed=1)
    plan = _planner()
    assert greedy_ok(greedy) and not needs_row(greedy) and plan.greedy_on_device([greedy])
    assert not needs_row(sampled) and plan.topk_on_device([sampled])
    assert plan.can_pipeline([greedy, sampled], True)
    # one request with logprobs: the step leaves the argmax and the pipeline for the top-k tail
    lp = _req(temperature=0.0, logprobs=3)
    assert not plan.greedy_on_device([greedy, lp]) and plan.topk_on_device([greedy, sampled, lp])
    assert not plan.can_pipeline([greedy, lp], True)
    # a grammar anywhere in the step: whole rows for all
    assert not plan.topk_on_device([lp, _req(grammar=True, temperature=0.0)])
