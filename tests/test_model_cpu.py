"""The Gemma 3 forward pass on the numpy backend, on tiny random GGUF models.

Checked against a dense reference written independently in this file (no paging, explicit masks),
and for the invariances the engine relies on: chunked prefill == one-shot prefill, a batch of sequences
== each alone, decode with a ring-buffered sliding-window cache == full recomputation.
Tolerance: relative error of the logits' scale <= 2e-5 with plain float32 numerics; <= 1e-2 with ggml
numerics, whose 8-bit activation rounding and float16 GELU table turn last-bit differences between
batch shapes into one rounding step (a cache or mask bug moves logits by O(1)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.composition import load_model
from hmad.core.batch import SeqSlice, StepBatch
from hmad.engine.generate import forward_full, generate
from hmad.engine.kvcache import KVCacheManager, KVLayout
from hmad.engine.sampling import SamplingParams

RTOL = 2e-5


@pytest.fixture(scope="module", params=[("f32", "f32"), ("mixed", "f32"), ("mixed", "ggml")], ids=str)
def tiny(request, tmp_path_factory):
    weights, numerics = request.param
    types = MIXED if weights == "mixed" else None
    path = make_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=7, types=types)
    return load_model(path, backend="cpu", numerics=numerics)


def tol(model):
    return 1e-2 if model.backend.ggml else RTOL


def close(a, b, rtol=RTOL):
    scale = max(np.abs(b).max(), 1e-6)
    err = np.abs(a - b).max() / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def dense_reference(model, ids):
    """Gemma 3 written out densely from the dequantized weights: (T,) ids -> (T, V) logits."""
    cfg, w = model.config, {k: v.f32 for k, v in model.backend.loaded.items()}
    t = len(ids)

    def norm(x, g):
        return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + cfg.rms_eps) * g

    def rope(x, base, scale):
        half = cfg.head_dim // 2
        freqs = 1.0 / base ** (np.arange(half) * 2 / cfg.head_dim)
        ang = np.arange(t)[:, None] / scale * freqs
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        return np.concatenate(
            [x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], -1
        )

    x = w["token_embd.weight"][ids].astype(np.float64) * math.sqrt(cfg.d_model)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = norm((h @ w[p + "attn_q.weight"].T).reshape(t, cfg.n_heads, -1), w[p + "attn_q_norm.weight"])
        k = norm((h @ w[p + "attn_k.weight"].T).reshape(t, cfg.n_kv_heads, -1), w[p + "attn_k_norm.weight"])
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, cfg.n_kv_heads, -1)
        base, scale = cfg.rope_for_layer(i)
        q, k = rope(q, base, scale), rope(k, base, scale)
        rep = cfg.n_heads // cfg.n_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * cfg.attn_scale
        qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
        mask = ki > qi
        if not cfg.layer_is_global[i]:
            mask |= qi - ki >= cfg.sliding_window
        s = np.where(mask, -np.inf, s)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", pr, v).reshape(t, -1) @ w[p + "attn_output.weight"].T
        x = x + norm(a, w[p + "post_attention_norm.weight"])
        h = norm(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        x = x + norm((gelu * u) @ w[p + "ffn_down.weight"].T, w[p + "post_ffw_norm.weight"])
    return norm(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def fresh_cache(model, seqs: list[list[int]], max_chunk: int) -> tuple[KVLayout, KVCacheManager]:
    """A KV cache (4-token blocks) for ``seqs`` on ``model``'s backend, each sequence's blocks reserved."""
    layout = KVLayout.plan(
        model.config, max_tokens=sum(map(len, seqs)), max_seqs=len(seqs), max_chunk=max_chunk, block_size=4
    )
    model.backend.alloc_kv(layout)
    kv = KVCacheManager(layout)
    for sid, ids in enumerate(seqs):
        kv.reserve(sid, len(ids))
    return layout, kv


def run_chunks(model, seqs: list[list[int]], chunk: int) -> list[np.ndarray]:
    """Feed several sequences together, ``chunk`` tokens of each per step; all rows' logits per sequence."""
    layout, kv = fresh_cache(model, seqs, chunk)
    out = [[] for _ in seqs]
    for p0 in range(0, max(map(len, seqs)), chunk):
        parts = []
        for sid, ids in enumerate(seqs):
            if p0 < len(ids):
                b = kv.tables(sid)
                parts.append(
                    (SeqSlice(sid, 0, 0, p0, b.global_table, b.local_table), ids[p0 : p0 + chunk], True)
                )
        batch = StepBatch.build(parts, layout.block_size)
        batch.logit_rows = np.arange(batch.n_tokens, dtype=np.int32)
        logits = model.forward(batch)
        for s, _, _ in parts:
            out[s.seq_id].append(logits[s.start : s.start + s.n])
    return [np.concatenate(o) for o in out]


def rand_ids(rng, n, vocab):
    return [2] + rng.integers(6, vocab, n - 1).tolist()


def test_forward_matches_dense_reference(tiny):
    if tiny.backend.ggml:
        pytest.skip("ggml numerics round like llama.cpp; the dense reference is plain float")
    ids = rand_ids(np.random.default_rng(), 29, tiny.config.vocab_size)
    close(forward_full(tiny, ids), dense_reference(tiny, ids))


def test_chunked_prefill_and_decode_match_full(tiny):
    ids = rand_ids(np.random.default_rng(), 40, tiny.config.vocab_size)
    full = forward_full(tiny, ids)
    for chunk in (1, 3, 16):
        close(run_chunks(tiny, [ids], chunk)[0], full, tol(tiny))


def test_batch_of_sequences_matches_each_alone(tiny):
    rng = np.random.default_rng()
    seqs = [rand_ids(rng, n, tiny.config.vocab_size) for n in (5, 23, 12)]
    together = run_chunks(tiny, seqs, chunk=7)
    for ids, got in zip(seqs, together, strict=True):
        close(got, forward_full(tiny, ids), tol(tiny))


def test_sliding_window_layers_keep_only_their_window(tiny):
    """A sequence far longer than the local ring decodes exactly as full recomputation."""
    ids = rand_ids(np.random.default_rng(), 60, tiny.config.vocab_size)
    layout = KVLayout.plan(tiny.config, 60, 1, max_chunk=2, block_size=4)
    assert layout.ring_blocks * 4 < 60  # the ring really wraps
    close(run_chunks(tiny, [ids], chunk=2)[0], forward_full(tiny, ids), tol(tiny))


def test_generate_batched_equals_alone(tiny):
    rng = np.random.default_rng()
    prompts = [rand_ids(rng, n, tiny.config.vocab_size) for n in (3, 17, 9, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    together = generate(tiny, prompts, greedy)
    for p, res in zip(prompts, together, strict=True):
        alone = generate(tiny, [p], greedy)[0]
        assert res.token_ids == alone.token_ids
        assert res.finish_reason in ("length", "stop")


def test_quant_types_load(tmp_path):
    types = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "ffn_up": Q.Q5_0, "ffn_gate": Q.F16}
    model = load_model(
        make_tiny_gguf(tmp_path / "k.gguf", seed=3, types=types), backend="cpu", numerics="f32"
    )
    ids = rand_ids(np.random.default_rng(), 11, model.config.vocab_size)
    close(forward_full(model, ids), dense_reference(model, ids))
