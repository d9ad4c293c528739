"""Each op of the numpy backend on fresh random inputs, against an independent formula or gguf.quants.

Tolerances (relative to the output's scale unless stated): plain float32 ops 1e-5; ggml-numerics
roundings: one quantization step (Q8 activations), 2^-10 relative (float16 GELU table), 1e-5 (RoPE angles
built in float32).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from hmad.backends import ggml_numerics as ggml
from hmad.backends.cpu import CpuBackend
from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.model_config import ModelConfig
from hmad.core.quants import random_blocks
from hmad.core.tensors import WeightTensor
from hmad.engine.kvcache import KVLayout

SEED = np.random.SeedSequence().entropy
RNG = np.random.default_rng(SEED)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def weight(qtype, shape):
    return WeightTensor("w", qtype, shape, random_blocks(qtype, shape, RNG))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_matmul_quantized_weight(qtype):
    be = CpuBackend(numerics="f32")
    w = weight(qtype, (96, 512))
    x = RNG.standard_normal((7, 512)).astype(np.float32)
    raw = w.data.view(np.uint8) if qtype == Q.BF16 else w.data  # gguf reads bf16 as raw bytes
    ref = x.astype(np.float64) @ gq.dequantize(raw, qtype).reshape(96, 512).T.astype(np.float64)
    out = np.full((7, 96), np.nan, np.float32)  # poisoned: every element must be written
    out[:] = be.matmul(x, be.load_weights({"w": w})["w"])
    assert rel(out, ref) <= 1e-5, f"seed {SEED}"


def test_matmul_outside_weight_cache_matches_cached():
    w = weight(Q.Q4_K, (20000, 256))
    x = RNG.standard_normal((3, 256)).astype(np.float32)
    cached, chunked = CpuBackend(numerics="f32"), CpuBackend(numerics="f32", weight_cache_bytes=0)
    a = cached.matmul(x, cached.load_weights({"w": w})["w"])
    b = chunked.matmul(x, chunked.load_weights({"w": w})["w"])
    assert chunked.loaded["w"].f32 is None
    assert rel(b, a) <= 1e-6


def test_q8_0_activation_rounding_matches_gguf():
    block = 32
    x = (RNG.standard_normal((5, 256)) * RNG.uniform(0.1, 100)).astype(np.float32)
    ours = ggml.round_activations(x, Q.Q5_0)
    ref = gq.dequantize(gq.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
    step = np.abs(x.reshape(-1, block)).max(1, keepdims=True) / 127
    diff = np.abs(ours - ref).reshape(-1, block)
    assert np.all(diff <= step * 1.01 + 1e-7), f"seed {SEED}"
    assert (diff > 1e-6 * step).mean() < 0.01  # ties may round differently (half-even vs half-away)


def test_q8_k_activation_rounding_is_within_one_step():
    x = RNG.standard_normal((4, 512)).astype(np.float32)
    ours = ggml.round_activations(x, Q.Q4_K).reshape(-1, 256)
    step = np.abs(x.reshape(-1, 256)).max(1, keepdims=True) / 127
    assert np.all(np.abs(ours - x.reshape(-1, 256)) <= step / 2 * 1.001)


def test_rms_norm():
    be = CpuBackend()
    x = RNG.standard_normal((9, 4, 64)).astype(np.float32) * 30
    w = WeightTensor("n", Q.F32, (64,), RNG.standard_normal(64).astype(np.float32))
    out = be.rms_norm(x, be.load_weights({"n": w})["n"], 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w.data
    assert rel(out, ref) <= 1e-5


@pytest.mark.parametrize("numerics", ["f32", "ggml"])
@pytest.mark.parametrize("base, scale", [(10_000.0, 1.0), (1_000_000.0, 8.0)])
def test_rope_matches_rotate_half(numerics, base, scale):
    be = CpuBackend(numerics=numerics)
    x = RNG.standard_normal((50, 3, 128)).astype(np.float32)
    pos = RNG.integers(0, 4000, 50)
    out = be.rope(x, pos, base, scale)
    inv = 1.0 / base ** (np.arange(0, 128, 2) / 128) / scale  # transformers: linear scaling divides freqs
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., 64:], x[..., :64]], -1)
    ref = x * np.cos(ang) + rot * np.sin(ang)
    # ggml builds angles by 63 float32 multiplications: ~1e-4 rad at position 4000
    assert rel(out, ref) <= (1e-5 if numerics == "f32" else 2e-3), f"seed {SEED}"


@pytest.mark.parametrize("numerics", ["f32", "ggml"])
def test_geglu(numerics):
    be = CpuBackend(numerics=numerics)
    g = (RNG.standard_normal((6, 300)) * 4).astype(np.float32)
    u = RNG.standard_normal((6, 300)).astype(np.float32)
    ref = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g.astype(np.float64) ** 3))) * u
    assert rel(be.geglu(g, u), ref) <= (1e-5 if numerics == "f32" else 2**-10)


def test_embed_scales_rows():
    be = CpuBackend()
    w = weight(Q.Q8_0, (50, 64))
    ids = RNG.integers(0, 50, 12)
    out = be.embed(be.load_weights({"e": w})["e"], ids, 8.0)
    ref = gq.dequantize(w.data, Q.Q8_0).reshape(50, 64)[ids] * 8.0
    assert rel(out, ref) <= 1e-6


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(window):
    """Two sequences in one batch, blocks scattered through the pool, GQA 4 over 2 heads."""
    cfg = ModelConfig(
        "gemma3",
        n_layers=6,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=64,
        vocab_size=10,
        sliding_window=5,
    )
    layer = 5 if window is None else 0
    lay = KVLayout.plan(cfg, max_tokens=64, max_seqs=2, max_chunk=20, block_size=4)
    be = CpuBackend()
    be.alloc_kv(lay)
    blocks = RNG.permutation(lay.n_global_blocks if window is None else lay.n_local_blocks).astype(np.int32)
    lens = [13, 20]
    slices = [SeqSlice(0, 0, 0, 0, blocks[:4], blocks[:4]), SeqSlice(1, 0, 0, 0, blocks[4:9], blocks[4:9])]
    batch = StepBatch.build([(s, [1] * n, True) for s, n in zip(slices, lens, strict=True)], 4)
    q = RNG.standard_normal((33, 4, 16)).astype(np.float32)
    k, v = (RNG.standard_normal((33, 2, 16)).astype(np.float32) for _ in range(2))
    out = be.attention(q, k, v, layer, batch, window, 0.25)
    for s in batch.seqs:
        r = slice(s.start, s.start + s.n)
        ref = dense_attention(q[r], k[r], v[r], window, 0.25)
        assert rel(out[r], ref) <= 1e-5


def dense_attention(q, k, v, window, scale):
    n = q.shape[0]
    k, v = np.repeat(k, 2, 1), np.repeat(v, 2, 1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    s[:, (j > i) | ((i - j >= window) if window else False)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(n, -1)
