"""Offline generation: run the scheduler in this thread until every prompt is answered.

Used by ``hmad generate`` (developers, benchmarks, the README's first command) and by tests; the daemon
drives the same Scheduler from its engine thread instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hmad.engine.request import Event, Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig


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
) -> list[Result]:
    """Generate for every prompt (text, or token ids) concurrently; returns results in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    sched = Scheduler(model, cfg or SchedulerConfig(max_seqs=max(1, len(prompts))))
    results = {}
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        p.validate()
        sched.submit(Request(i, ids, dataclasses.replace(p)))
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
