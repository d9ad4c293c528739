"""Where a step's tokens are picked (engine/planning.py): a request with logprobs, or with prompt logprobs
while it prefills, is served from the device's top-k candidates, row log-sum-exps (and its prompt tokens'
gathered logits) when they can give its tokens and their alternatives (no grammar, no repetition penalty, at
most ``topk_max`` candidates), else from whole rows; it never takes the device's argmax and is never
pipelined. Each prompt-logprobs row's target is the prompt token after it. No device: a stand-in model with
the backend's flags."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hmad.core.batch import StepBatch
from hmad.engine.planning import (
    PROMPT_ROWS_MAX,
    StepPlanner,
    candidates_needed,
    greedy_ok,
    needs_row,
    prompt_targets,
)
from hmad.engine.request import Request, State
from hmad.engine.sampling import Sampler, SamplingParams

TOPK_MAX = 128


def _req(state: State = State.DECODE, grammar: bool = False, prompt=(5, 6, 7, 6), rid=0, **params) -> Request:
    p = SamplingParams(**{"max_tokens": 8, **params})
    p.validate()
    r = Request(rid, list(prompt), p, state=state)
    r.sampler = Sampler(p)
    r.grammar_state = object() if grammar else None  # a grammar's state: it masks the row
    return r


def _planner(topk_max: int = TOPK_MAX, step_tokens: int = 64, max_chunk: int = 16) -> StepPlanner:
    be = SimpleNamespace(
        topk_max=topk_max,
        bias_max=64,
        pipelined=True,
        sample_on_device=True,
        greedy_on_device=True,
    )
    model = SimpleNamespace(backend=be, config=SimpleNamespace(vocab_size=1000))
    # a KV cache that always has room: the tables are not looked at here
    tables = SimpleNamespace(global_table=np.zeros(1, np.int32), local_table=np.zeros(1, np.int32))
    kv = SimpleNamespace(prepare=lambda *a, **k: tables)
    return StepPlanner(model, kv=kv, step_tokens=step_tokens, max_chunk=max_chunk, context=4096)


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
        # prompt rows: the same rules while they are read
        {"state": State.PREFILL, "grammar": True, "temperature": 0.0, "prompt_logprobs": 1},
        {"state": State.PREFILL, "temperature": 0.0, "prompt_logprobs": 1, "repetition_penalty": 1.3},
        {"state": State.PREFILL, "temperature": 0.8, "top_k": 0, "prompt_logprobs": 1},
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


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"temperature": 0.0, "prompt_logprobs": 0}, 1),
        ({"temperature": 0.0, "prompt_logprobs": 5}, 5),
        ({"temperature": 0.8, "top_k": 40, "prompt_logprobs": 5, "logit_bias": {3: 5.0}}, 40),
        ({"temperature": 0.0, "prompt_logprobs": 20, "logprobs": 3}, 20),
        ({"temperature": 0.0, "prompt_logprobs": 2, "logprobs": 7}, 7),
    ],
)
def test_prompt_logprobs_take_the_topk_path_while_prefilling(params, want):
    """A prefilling request with prompt logprobs: every row of its chunks from the top-k tail (candidates,
    log-sum-exp, the prompt token's gathered logit), never the argmax or the pipeline; a backend without a
    top-k reads its rows whole."""
    r, plan = _req(state=State.PREFILL, **params), _planner()
    assert candidates_needed(r) == want
    assert not needs_row(r, TOPK_MAX) and not greedy_ok(r)
    assert plan.topk_on_device([r]) and not plan.greedy_on_device([r])
    assert not plan.can_pipeline([r], True)
    assert needs_row(r) and not _planner(0).topk_on_device([r])  # the numpy backend: whole rows
    assert needs_row(r, want - 1) and not _planner(want - 1).topk_on_device([r])


def test_prompt_logprobs_count_only_while_prefilling():
    """Once its prompt is cached a request's prompt logprobs ask nothing of its rows: greedy again."""
    r, plan = _req(state=State.DECODE, temperature=0.0, prompt_logprobs=20), _planner()
    assert greedy_ok(r) and candidates_needed(r) == 1 and plan.greedy_on_device([r])


def test_prompt_targets_are_the_next_prompt_tokens():
    r = _req(prompt=(5, 6, 7, 6))
    assert prompt_targets(r, 0, 4).tolist() == [6, 7, 6, -1]  # the last row draws the first token
    assert prompt_targets(r, 1, 2).tolist() == [7, 6]
    assert prompt_targets(r, 3, 1).tolist() == [-1]
    assert prompt_targets(r, 0, 4).dtype == np.int32


def test_a_planned_prompt_logprobs_chunk_carries_its_targets_into_the_batch():
    """A 100-token prompt with prompt logprobs beside a decoding request: its chunks (PROMPT_ROWS_MAX
    rows at most) give every row a target, the next prompt token (the prompt's last row: -1), each at its
    logit row in StepBatch.targets; the other request's row: -1."""
    prompt = [int(i) for i in np.random.default_rng(0).integers(1, 999, 100)]
    lp = _req(state=State.PREFILL, prompt=prompt, rid=1, temperature=0.0, prompt_logprobs=3)
    dec = _req(state=State.DECODE, rid=2, temperature=0.0)
    dec.n_cached, dec.output_ids = 5, [9]
    plan = _planner(step_tokens=200, max_chunk=200)
    seen = []
    while lp.n_cached < len(prompt):
        first = lp.n_cached
        parts = plan.plan([dec, lp], {})
        batch = StepBatch.build([(s, toks, want) for _, s, toks, want in parts], 16)
        (s,) = [s for r, s, _, _ in parts if r is lp]
        assert s.all_rows and s.n <= PROMPT_ROWS_MAX and lp.step_rows == s.n
        assert batch.targets.tolist() == [-1, *s.targets.tolist()]  # dec's row first (decode first)
        assert len(batch.targets) == len(batch.logit_rows)
        seen += [(first + j, int(t)) for j, t in enumerate(s.targets)]
    assert seen == [(p, prompt[p + 1]) for p in range(99)] + [(99, -1)]
    # without prompt logprobs no step has targets
    parts = _planner().plan([_req(state=State.PREFILL, prompt=prompt, temperature=0.0)], {})
    assert StepBatch.build([(s, t, w) for _, s, t, w in parts], 16).targets is None
