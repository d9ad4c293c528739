"""StepBatch: the per-step values one forward pass reads (tokens, positions, sequences, block tables).

The forward pass is written over a flat batch of T tokens drawn from S sequences, vLLM-style: a decoding
sequence adds 1 token, a prefilling one a chunk of its prompt. Backends never look at Python objects other
than these arrays, so the Vulkan backend can copy them into one small host-visible buffer per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: a logit row's sampling as the device draws it (``StepBatch.sampling``; shaders/sample_topk.comp): the
#: request's temperature (0: greedy), top_k, top_p, min_p, and the uniform its draw uses
SAMPLE_DTYPE = np.dtype(
    [("temperature", "<f4"), ("top_k", "<u4"), ("top_p", "<f4"), ("min_p", "<f4"), ("u", "<f4")]
)
#: one additive adjustment of a logit row (``StepBatch.bias``; shaders/logit_bias.comp): the logit row (its
#: index among the step's logit rows), the token, and the float32 delta added to that logit
BIAS_DTYPE = np.dtype([("row", "<u4"), ("token", "<u4"), ("delta", "<f4")])


@dataclass
class SeqSlice:
    """One sequence's part of a step: rows ``start:start+n`` of the flat batch, positions ``pos0:pos0+n``."""

    seq_id: int
    start: int
    n: int
    pos0: int
    global_table: np.ndarray  # (n_blocks,) int32: block j holds positions [j*B, (j+1)*B) (may be shared)
    local_table: np.ndarray  # (ring,) int32: position p lives in block local_table[(p // B) % ring]
    # (valid for the positions this step writes or reads; engine/kvcache.py)
    # (token ids int32, deltas float32) or None: added to this part's logit row (if it wants one) before a
    # device picks or pre-selects its token (``StepBatch.bias``; the request's Sampler.adjustments)
    bias: tuple[np.ndarray, np.ndarray] | None = None
    # wanting logits, every position's row rather than the last one's (a request's prompt logprobs)
    all_rows: bool = False
    # (n,) int32 or None: with ``all_rows``, per row the token whose logit the step also gathers (the prompt
    # token after that position; -1: none, e.g. the prompt's last row) (``StepBatch.targets``)
    targets: np.ndarray | None = None
    # (n,) int32 or None: per row, the last position its query sees (None: its own, causal). An image's soft
    # tokens see the whole image (Gemma 3's bidirectional image attention: engine/images.py)
    visible: np.ndarray | None = None
    # (rows (k,) int32 within the part, values (k, D) float32) or None: input embeddings that replace those
    # rows' token embeddings (an image's soft tokens; ``StepBatch.embeds``)
    embeds: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def end_pos(self) -> int:
        """One past the last position written this step (the sequence's cached length after the step)."""
        return self.pos0 + self.n


@dataclass
class StepBatch:
    """Everything the forward pass needs for one step, as plain arrays."""

    tokens: np.ndarray  # (T,) int32
    positions: np.ndarray  # (T,) int32
    seqs: list[SeqSlice]
    logit_rows: np.ndarray  # (S_out,) int32: rows of the flat batch whose logits the step returns
    block_size: int = 16
    meta: dict = field(default_factory=dict)
    # (T,) int32 or None: a pipelined step's rows whose token the device takes from the step before it,
    # from that step's ids row feed[t] (-1: the token in ``tokens``; Backend.launch_greedy)
    feed: np.ndarray | None = None
    # (S_out,) SAMPLE_DTYPE or None: how the device samples each logit row (Backend.launch_sampled)
    sampling: np.ndarray | None = None
    # (n,) BIAS_DTYPE: deltas a backend adds to the logit rows before its argmax, top-k or draw (greedy,
    # topk, launch_*), each (row, token) at most once; full rows (``run``'s logits) come back without them:
    # the host sampler adds the same deltas itself (engine/sampling.py, step 0)
    bias: np.ndarray = field(default_factory=lambda: np.zeros(0, BIAS_DTYPE))
    # (S_out,) int32 or None: per logit row, the token whose logit (after ``bias``) a backend's ``topk``
    # gathers too (Backend.topk_targets: a prompt token's logprob), -1 for a row with none; None: no row has
    targets: np.ndarray | None = None
    # (T,) int32 or None: per row, the last position its query sees (None: every row's own; SeqSlice.visible)
    visible: np.ndarray | None = None
    # (R,) int32 and (R, D) float32, or None: rows of the flat batch whose input embedding is the given
    # vector, not the (scaled) token embedding (an image's soft tokens: model/gemma3.py)
    embed_rows: np.ndarray | None = None
    embeds: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def build(
        parts: list[tuple[SeqSlice, np.ndarray, bool]],
        block_size: int,
        feed: list[int] | None = None,
        sampling: np.ndarray | None = None,
    ) -> StepBatch:
        """Assemble a batch from (slice without start, its token ids, wants logits of its last token, or of
        each of its tokens with ``SeqSlice.all_rows``);
        ``feed``: per part, the previous step's ids row its one token comes from, or -1 (see ``feed``);
        ``sampling``: per logit row (see ``sampling``)."""
        tokens, positions, seqs, rows, start, bias, targets, given = [], [], [], [], 0, [], [], False
        for s, toks, want in parts:
            s.start, s.n = start, len(toks)
            tokens.append(np.asarray(toks, dtype=np.int32))
            positions.append(np.arange(s.pos0, s.pos0 + s.n, dtype=np.int32))
            if want:
                if s.all_rows:
                    rows += range(start, start + s.n - 1)
                if s.bias is not None and len(s.bias[0]):
                    bias.append(_bias_entries(len(rows), *s.bias))
                rows.append(start + s.n - 1)
                targets.append(_targets(s))
                given = given or s.targets is not None
            seqs.append(s)
            start += s.n
        fed = None
        if feed is not None and any(f >= 0 for f in feed):
            fed = np.full(start, -1, np.int32)
            for s, f in zip(seqs, feed, strict=True):
                if f >= 0:
                    assert s.n == 1, "a fed part is one decode token"
                    fed[s.start] = f
        return StepBatch(
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
            positions=np.concatenate(positions) if positions else np.zeros(0, np.int32),
            seqs=seqs,
            logit_rows=np.asarray(rows, dtype=np.int32),
            block_size=block_size,
            feed=fed,
            sampling=sampling,
            bias=np.concatenate(bias) if bias else np.zeros(0, BIAS_DTYPE),
            targets=np.concatenate(targets) if given else None,
            visible=_visible(seqs),
            **_embeds(seqs),
        )


def add_bias(logits: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``logits`` (S_out, V) float32 plus ``bias`` (BIAS_DTYPE entries): one float32 add per entry, as
    shaders/logit_bias.comp adds them (a copy; the rows themselves when there is none)."""
    if not len(bias):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    out[bias["row"], bias["token"]] += bias["delta"]
    return out


def _targets(s: SeqSlice) -> np.ndarray:
    """The targets of ``s``'s logit rows (all its rows with ``all_rows``, else its last): -1 where none."""
    n = s.n if s.all_rows else 1
    if s.targets is None:
        return np.full(n, -1, np.int32)
    assert s.all_rows and len(s.targets) == n, "targets: one a row of an all_rows slice"
    return np.asarray(s.targets, np.int32)


def _visible(seqs: list[SeqSlice]) -> np.ndarray | None:
    """The flat (T,) visible positions, or None when every row sees only up to its own."""
    if all(s.visible is None for s in seqs):
        return None
    own = [np.arange(s.pos0, s.end_pos, dtype=np.int32) for s in seqs]
    return np.concatenate([o if s.visible is None else s.visible for s, o in zip(seqs, own, strict=True)])


def _embeds(seqs: list[SeqSlice]) -> dict[str, np.ndarray | None]:
    """``embed_rows`` and ``embeds`` of the flat batch from its slices' own."""
    given = [(s.start + rows, vals) for s in seqs if s.embeds is not None for rows, vals in [s.embeds]]
    if not given:
        return {"embed_rows": None, "embeds": None}
    return {
        "embed_rows": np.concatenate([r for r, _ in given]).astype(np.int32),
        "embeds": np.concatenate([v for _, v in given]).astype(np.float32, copy=False),
    }


def _bias_entries(row: int, ids: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """One logit row's (ids, deltas) as BIAS_DTYPE entries."""
    out = np.empty(len(ids), BIAS_DTYPE)
    out["row"], out["token"], out["delta"] = row, ids, deltas
    return out
