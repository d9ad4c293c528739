"""Offline generation: run the scheduler in this thread until every prompt is answered.

Used by ``hmad generate`` (developers, benchmarks, the README's first command) and by tests; the daemon
drives the same Scheduler from its engine thread instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.engine.images import ImageSpan
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Event, Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig
from hmad.engine.structured import compile_schema


@dataclass
class Result:
    """One finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


def generate(
    model,
    prompts: list[str | list[int]],
    params: list[SamplingParams] | SamplingParams,
    cfg: SchedulerConfig | None = None,
    on_event: Callable[[Event], None] | None = None,
    json_schemas: list[dict[str, Any] | None] | dict[str, Any] | None = None,
    images: list[list[ImageSpan]] | None = None,
) -> list[Result]:
    """Generate for every prompt (text, or token ids) concurrently; returns results in prompt order.

    Without ``cfg`` the KV cache is sized to what these prompts can use (prompt + max_tokens each).
    ``json_schemas``: one JSON Schema for every prompt, or one (or None) per prompt, that the answers must
    satisfy (ValueError names a schema that cannot be compiled); their stats say ``schema_complete``.
    ``images``: per prompt (token ids with the soft tokens in place: hmad.preparation), its images' spans.
    """
    plist = params if isinstance(params, list) else [params] * len(prompts)
    slist = json_schemas if isinstance(json_schemas, list) else [json_schemas] * len(prompts)
    grammars = [None if s is None else compile_schema(s) for s in slist]
    encoded = [model.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if cfg is None:
        ctx = model.config.context_length
        need = sum(min(len(ids) + p.max_tokens, ctx) for ids, p in zip(encoded, plist, strict=True))
        cfg = SchedulerConfig(max_seqs=max(1, len(prompts)), kv_tokens=max(need, 16))
    sched = Scheduler(model, cfg)
    results = {}
    for i, (ids, p, g) in enumerate(zip(encoded, plist, grammars, strict=True)):
        p.validate()
        req = Request(i, ids, dataclasses.replace(p), grammar=g)
        req.images = list(images[i]) if images else []
        sched.submit(req)
        results[i] = Result(ids)
    while sched.has_work():
        for ev in sched.step():
            _apply(results[ev.request_id], ev)
            if on_event:
                on_event(ev)
    return [results[i] for i in range(len(prompts))]


def _apply(res: Result, ev: Event) -> None:
    if ev.kind == "token":
        res.text += ev.text
        res.token_ids += ev.token_ids
    elif ev.terminal:
        res.finish_reason, res.stats = ev.finish_reason or ev.kind, ev.stats


def forward_full(model, token_ids: list[int]) -> np.ndarray:
    """Logits (T, V) of every position of one sequence, from an empty cache.

    A test and debugging helper: it allocates its own KV pools, so not for use while an engine runs.
    """
    n = len(token_ids)
    layout = KVLayout.plan(model.config, max_tokens=n, max_seqs=1, max_chunk=n)
    model.backend.alloc_kv(layout)
    blocks = KVCacheManager(layout).reserve(0, n)
    s = SeqSlice(0, 0, n, 0, blocks.global_table, blocks.local_table)
    batch = StepBatch.build([(s, token_ids, True)], layout.block_size)
    batch.logit_rows = np.arange(n, dtype=np.int32)
    return model.forward(batch)
