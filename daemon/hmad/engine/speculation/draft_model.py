"""A draft model: a small model of the target's vocabulary proposes each sequence's next k tokens greedily.

``speculation.mode: draft`` with ``speculation.draft_model`` (a GGUF path, ``default``: the embedded 270M,
or a pulled model's name). The draft is loaded on its own backend of the target's kind and device
(``hmad.composition.load_draft``, the floor that loads models): its weights, KV pools and recorded steps
are its own, never the target's.

Its KV cache is kept in step with each speculating sequence lazily. ``fed[id]`` is the tokens whose
positions the draft's cache holds. A round (``propose_batch``) keeps the longest prefix of ``fed`` that is
still the sequence's (prompt + output: the drafts the target rejected are not), gives the positions past
it back (``KVCacheManager.rollback``), feeds the rest of the sequence (its prompt, chunked, the first time)
and then its own argmax k - 1 times: k decode steps, each one batched over every sequence still drafting.
A sequence's blocks go back when it ends (``release``, from the scheduler's release of the request).

Requests with images are not drafted for (the draft would need their soft tokens).
"""

from __future__ import annotations

import logging

import numpy as np

from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.errors import ModelFormatError
from hmad.core.kv_layout import KVLayout
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Request

log = logging.getLogger("hmad.engine")


def check_vocabulary(target, draft) -> None:
    """ModelFormatError naming both files unless ``draft`` has ``target``'s vocabulary: the same size (its
    embedding rows and its tokenizer's) and the same text for every token."""
    tt, dt = target.tokenizer, draft.tokenizer
    sizes = (target.config.vocab_size, tt.vocab_size), (draft.config.vocab_size, dt.vocab_size)
    problem = None
    if sizes[0] != sizes[1]:
        problem = f"vocabulary sizes differ: {sizes[1][1]} tokens (draft), {sizes[0][1]} (target)"
    else:
        bad = _first_difference(tt, dt)
        if bad is not None:
            t, d = tt.token_bytes(bad, True), dt.token_bytes(bad, True)
            problem = f"token {bad} differs: {d!r} (draft), {t!r} (target)"
    if problem:
        raise ModelFormatError(
            draft.path, f"a draft model needs the target's vocabulary ({target.path}); {problem}"
        )


def _first_difference(a, b) -> int | None:
    """The first token id whose text differs between tokenizers ``a`` and ``b`` of one size, or None."""
    ta, tb = getattr(a, "_text", None), getattr(b, "_text", None)  # a GGUF vocabulary's texts: one compare
    if ta is not None and tb is not None and ta == tb:
        return None
    return next((i for i in range(a.vocab_size) if a.token_bytes(i, True) != b.token_bytes(i, True)), None)


class DraftModelDrafter:
    """Drafts from a draft model (module docstring); ``propose_batch`` drafts for many sequences at once."""

    def __init__(
        self, model, step_tokens: int, max_chunk: int, max_seqs: int, kv_tokens: int, block_size: int
    ):
        self.model = model
        self.step_tokens, self.max_chunk = step_tokens, min(max_chunk, step_tokens)  # a chunk fits a step
        self.layout = KVLayout.plan(model.config, kv_tokens, max_seqs, max_chunk, block_size)
        model.backend.alloc_kv(self.layout)
        self.kv = KVCacheManager(self.layout, prefix_cache=False)
        self.fed: dict[int, list[int]] = {}  # request id -> the tokens its draft KV positions hold
        self.sure: dict[int, int] = {}  # request id -> how many of them were its tokens at the last round
        self.steps = 0  # draft forward passes

    @classmethod
    def attach(cls, scheduler, model) -> DraftModelDrafter:
        """A drafter sized as ``scheduler``'s KV cache, made its speculator's drafter."""
        c = scheduler.cfg
        drafter = cls(model, c.step_tokens, c.max_chunk, c.max_seqs, c.kv_tokens, c.block_size)
        scheduler.speculator.drafter = drafter
        return drafter

    def propose(self, r: Request, k: int) -> list[int]:
        return self.propose_batch([(r, k)]).get(r.id, [])

    def propose_batch(self, wanted: list[tuple[Request, int]]) -> dict[int, list[int]]:
        """Request id -> its k draft tokens (the draft's greedy continuation), for each (request, k)."""
        todo = {r.id: (r, k) for r, k in wanted if k > 0 and not r.images and self._sync(r)}
        base = {i: len(r.prompt_ids) + len(r.output_ids) for i, (r, _) in todo.items()}
        feed = {i: self._pending(r) for i, (r, _) in todo.items()}
        while any(len(f) > self.max_chunk for f in feed.values()):  # a long catch-up: prompt chunks first
            long = {i: f[: self.max_chunk] for i, f in feed.items() if len(f) > self.max_chunk}
            self._step(long, base)
            feed.update({i: feed[i][self.max_chunk :] for i in long})
        out: dict[int, list[int]] = {i: [] for i in todo}
        for j in range(max((k for _, k in todo.values()), default=0)):
            ids = self._step({i: feed[i] for i, (_, k) in todo.items() if j < k}, base)
            for i, t in ids.items():
                out[i].append(t)
                feed[i] = [t]
        return out

    def release(self, request_id: int) -> None:
        """The request ended: its draft KV blocks go back."""
        self.kv.release(request_id)
        self.fed.pop(request_id, None)
        self.sure.pop(request_id, None)

    def close(self) -> None:
        self.model.backend.close()

    def describe(self) -> dict:
        """What status shows of the draft: its name, file and memory (as the model's ``memory``)."""
        return {
            "model": self.model.path,
            "model_name": self.model.config.name,
            "memory": self.model.backend.describe().get("memory", {}),
            "steps": self.steps,
            "sequences": len(self.fed),
        }

    # -- its KV cache ------------------------------------------------------------------------------------
    def _sync(self, r: Request) -> bool:
        """``r``'s draft KV cut to the longest prefix still its own (False: no room in the draft's pools)."""
        fed = self.fed.get(r.id)
        if fed is None:
            if self.kv.admit(r.id, r.n_positions) is None:
                return False
            fed = self.fed[r.id] = []
            self.sure[r.id] = 0
        tokens = r.prompt_ids + r.output_ids
        n = min(self.sure[r.id], len(fed))  # (positions before it were the sequence's last round: still are)
        for a, b in zip(fed[n:], tokens[n:-1], strict=False):  # the last token fed again: its row is wanted
            if a != b:
                break
            n += 1
        self.sure[r.id] = len(tokens) - 1
        if n < len(fed) and not self.kv.can_rewrite(r.id, n):  # its window's blocks gone: from the start
            self.release(r.id)
            return self._sync(r)
        if n < len(fed):
            self.kv.rollback(r.id, n)
            del fed[n:]
        return True

    def _pending(self, r: Request) -> list[int]:
        """``r``'s tokens its draft KV does not hold yet."""
        return (r.prompt_ids + r.output_ids)[len(self.fed[r.id]) :]

    def _step(self, feed: dict[int, list[int]], base: dict[int, int]) -> dict[int, int]:
        """Feed each sequence its tokens (split over several forward passes past ``step_tokens``): request
        id -> the draft's argmax after its last. Positions from ``base`` on (this round's drafts) keep the
        window's blocks a later round may write again from (``prepare``'s ``keep_back``)."""
        out, group, size = {}, [], 0
        for i, toks in feed.items():
            if group and size + len(toks) > self.step_tokens:
                out.update(self._forward(group, base))
                group, size = [], 0
            group.append((i, toks))
            size += len(toks)
        if group:
            out.update(self._forward(group, base))
        return out

    def _forward(self, group: list[tuple[int, list[int]]], base: dict[int, int]) -> dict[int, int]:
        parts = []
        for i, toks in group:
            pos0 = len(self.fed[i])
            tables = self.kv.prepare(i, pos0, len(toks), keep_back=max(0, pos0 - base[i]))
            parts.append(
                (SeqSlice(i, 0, len(toks), pos0, tables.global_table, tables.local_table), toks, True)
            )
            self.fed[i] += toks
        ids = np.asarray(self.model.forward_argmax(StepBatch.build(parts, self.layout.block_size)))  # (S,)
        self.steps += 1
        return {i: int(t) for (i, _), t in zip(group, ids.tolist(), strict=True)}
