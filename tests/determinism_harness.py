"""Drive a model through random mixes of sequences, for the batch-invariance tests (issue 16).

A *schedule* is a list of steps; a step a list of (sequence, rows) in batch order: a sequence feeds its next
``rows`` tokens (1: a decode-like row, more: a prefill chunk). ``run_schedule`` runs one and returns every
row's logits per sequence, so a sequence's logits in a mix can be compared with its solo run bit for bit.
"""

from __future__ import annotations

import numpy as np
from test_model_cpu import fresh_cache

from hmad.core.batch import SeqSlice, StepBatch

Step = list[tuple[int, int]]


def rand_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """A BOS and n - 1 random ordinary tokens."""
    return [2] + rng.integers(6, vocab, n - 1).tolist()


def solo_schedule(rng: np.random.Generator, sid: int, n: int, max_chunk: int) -> list[Step]:
    """Sequence ``sid`` alone, its n tokens in random chunks of 1..max_chunk."""
    steps, done = [], 0
    while done < n:
        c = int(rng.integers(1, min(max_chunk, n - done) + 1))
        steps.append([(sid, c)])
        done += c
    return steps


def mixed_schedule(rng: np.random.Generator, lens: list[int], max_chunk: int) -> list[Step]:
    """Every sequence in one run: each step takes a random subset of the unfinished ones, each with one row
    (half the time) or a random chunk, in a random order in the batch."""
    left = dict(enumerate(lens))
    steps = []
    while left:
        ids = list(left)
        pick = rng.choice(ids, size=int(rng.integers(1, len(ids) + 1)), replace=False)
        step = []
        for sid in rng.permutation(pick).tolist():
            c = 1 if rng.random() < 0.5 else int(rng.integers(1, min(max_chunk, left[sid]) + 1))
            step.append((sid, c))
            left[sid] -= c
            if not left[sid]:
                del left[sid]
        steps.append(step)
    return steps


def run_schedule(model, seqs: list[list[int]], steps: list[Step], max_chunk: int) -> list[np.ndarray]:
    """Run ``steps`` over ``seqs`` on a fresh KV cache; every row's logits, (len(seq), V) per sequence."""
    layout, kv = fresh_cache(model, seqs, max_chunk)
    done = [0] * len(seqs)
    out: list[list[np.ndarray]] = [[] for _ in seqs]
    for step in steps:
        parts = []
        for sid, c in step:
            b = kv.tables(sid)
            s = SeqSlice(sid, 0, 0, done[sid], b.global_table, b.local_table)
            parts.append((s, seqs[sid][done[sid] : done[sid] + c], True))
            done[sid] += c
        batch = StepBatch.build(parts, layout.block_size)
        batch.logit_rows = np.arange(batch.n_tokens, dtype=np.int32)
        logits = model.forward(batch)
        for s, _, _ in parts:
            out[s.seq_id].append(np.array(logits[s.start : s.start + s.n]))
    return [np.concatenate(o) for o in out]


def solo_logits(model, rng, seqs: list[list[int]], max_chunk: int) -> list[np.ndarray]:
    """Each sequence alone (the others absent), in random chunks."""
    return [
        run_schedule(model, [ids], solo_schedule(rng, 0, len(ids), max_chunk), max_chunk)[0] for ids in seqs
    ]


def first_mismatch(a: np.ndarray, b: np.ndarray) -> str | None:
    """None when bit-identical, else where they first differ and by how much."""
    if np.array_equal(a, b):
        return None
    row = int(np.flatnonzero((a != b).any(axis=-1))[0])
    return f"row {row} of {len(a)}: max |diff| {np.abs(a[row] - b[row]).max():.3g}"
