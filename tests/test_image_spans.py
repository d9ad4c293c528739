"""An image's soft tokens in a sequence (engine/images.py) and the attention mask they make, on the numpy
backend, against a dense reference written here from Gemma 3's rule: a soft token sees every token before
it and every soft token of its own image; the sliding window counts back from its own position.

Tolerance: 1e-5 relative (float32 against float64).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hmad.backends.cpu import CpuBackend
from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.model_config import ModelConfig
from hmad.engine import images
from hmad.engine.images import FeatureCache, ImageEncoder, ImageSpan
from hmad.engine.kvcache import KVLayout

SEED = np.random.SeedSequence().entropy
RNG = np.random.default_rng(SEED)


def span(start: int, n: int, tag: bytes = b"a") -> ImageSpan:
    return ImageSpan(start, n, hashlib.sha256(tag).hexdigest())


def test_visible_rows_see_their_whole_image_and_only_it():
    spans = [span(3, 4), span(10, 2, b"b")]
    vis = images.visible(spans, 0, 14)
    assert vis.tolist() == [0, 1, 2, 6, 6, 6, 6, 7, 8, 9, 11, 11, 12, 13]
    assert images.visible(spans, 7, 3) is None  # text only between the images
    assert images.visible(spans, 5, 3).tolist() == [6, 6, 7]  # a chunk starting inside an image


@pytest.mark.parametrize(
    "pos0, n, want",
    [(0, 5, 3), (0, 7, 7), (0, 2, 2), (3, 2, 0), (4, 10, 10), (4, 2, 0), (7, 4, 3), (7, 5, 5)],
)
def test_a_chunk_never_ends_inside_an_image(pos0, n, want):
    spans = [span(3, 4), span(10, 2, b"b")]
    assert images.chunk_end(spans, pos0, n) == want


def test_embeds_gives_the_rows_and_features_of_the_part():
    a, b = span(2, 3), span(7, 2, b"b")
    a.features = RNG.standard_normal((3, 4)).astype(np.float32)
    b.features = RNG.standard_normal((2, 4)).astype(np.float32)
    rows, vals = images.embeds([a, b], 1, 8)  # positions 1..8
    assert rows.tolist() == [1, 2, 3, 6, 7]
    np.testing.assert_array_equal(vals, np.concatenate([a.features, b.features]))
    rows, vals = images.embeds([a, b], 3, 2)  # positions 3..4: a's last two soft tokens
    assert rows.tolist() == [0, 1]
    np.testing.assert_array_equal(vals, a.features[1:])
    assert images.embeds([a, b], 5, 2) is None


def test_cache_keys_tell_images_apart_and_are_never_token_ids():
    ids = [2, 10, 11, 0, 0, 0, 0, 12]
    one, other = images.key_ids(ids, [span(3, 4)]), images.key_ids(ids, [span(3, 4, b"other")])
    assert one[:3] == ids[:3] and one[7:] == ids[7:]
    assert one != other and all(k < 0 for k in one[3:7])
    assert len(set(one[3:7])) == 4  # each soft token keyed apart
    assert images.key_ids(ids, [span(3, 4)]) == one  # deterministic


def test_feature_cache_drops_the_least_recently_used_past_its_bytes():
    cache = FeatureCache(max_bytes=3 * 64)
    f = {k: np.full((4, 4), i, np.float32) for i, k in enumerate("abcd")}  # 64 bytes each
    for k in "abc":
        cache.put(k, f[k])
    assert cache.get("a") is f["a"]  # a is now the most recent
    cache.put("d", f["d"])
    assert cache.get("b") is None and cache.get("a") is f["a"] and cache.get("d") is f["d"]
    assert cache.bytes == 3 * 64


def test_the_encoder_runs_each_distinct_image_once_and_then_from_cache():
    calls = []

    def encode(px):
        calls.append(px.shape[0])
        return px.reshape(px.shape[0], 2, -1)[:, :, :3] * 2  # (n, 2, 3): any function of the pixels

    enc = ImageEncoder(encode, cache_bytes=1 << 20)
    spans = [span(1, 2), span(5, 2, b"b"), span(9, 2)]  # the first image twice
    for s in spans:
        s.pixels = np.full((3, 2, 2), 1.0 if s.digest == spans[0].digest else 2.0, np.float32)
    enc.encode(spans)
    assert calls == [2] and enc.encoded == 2
    assert spans[0].features is spans[2].features
    again = [span(3, 2, b"b")]
    again[0].pixels = np.zeros((3, 2, 2), np.float32)  # (not read: the cache has b)
    enc.encode(again)
    assert calls == [2] and again[0].pixels is None
    np.testing.assert_array_equal(again[0].features, spans[1].features)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_of_image_rows_matches_a_dense_mask(window):
    """Two sequences in one step, one with two images (the second starting in a later chunk), one text
    only; GQA 4 over 2 heads; blocks scattered; the first chunk's keys come from the cache."""
    cfg = ModelConfig(
        "gemma3", n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64, vocab_size=10,
        sliding_window=6,
    )  # fmt: skip
    layer = 5 if window is None else 0
    lay = KVLayout.plan(cfg, max_tokens=64, max_seqs=2, max_chunk=24, block_size=4)
    be = CpuBackend()
    be.alloc_kv(lay)
    blocks = RNG.permutation(lay.n_global_blocks if window is None else lay.n_local_blocks).astype(np.int32)
    spans = [span(2, 4), span(11, 5, b"b")]
    t, n1 = 20, 8  # sequence 0: positions 0..7 in step one, 8..19 in step two
    q = RNG.standard_normal((t, 4, 16)).astype(np.float32)
    k, v = (RNG.standard_normal((t, 2, 16)).astype(np.float32) for _ in range(2))
    table0 = blocks[:6]
    out = np.full((t, 64), np.nan, np.float32)  # poisoned
    for pos0, n in ((0, n1), (n1, t - n1)):
        s = SeqSlice(0, 0, n, pos0, table0, table0, visible=images.visible(spans, pos0, n))
        other = SeqSlice(1, 0, 3, 0, blocks[6:8], blocks[6:8])
        batch = StepBatch.build([(s, [1] * n, True), (other, [1] * 3, True)], 4)
        r = slice(pos0, pos0 + n)
        qq = np.concatenate([q[r], q[:3]])
        kk, vv = np.concatenate([k[r], k[:3]]), np.concatenate([v[r], v[:3]])
        out[r] = be.attention(qq, kk, vv, layer, batch, window, 0.25)[:n]
    ref = dense(q, k, v, images.visible(spans, 0, t), window, 0.25)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), f"seed {SEED}"


def dense(q, k, v, visible, window, scale):
    """Attention with the mask written out: row i sees key j when j <= visible[i] and i - j < window."""
    n = q.shape[0]
    k, v = np.repeat(k, 2, 1).astype(np.float64), np.repeat(v, 2, 1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    s[:, (j > visible[:, None]) | ((i - j >= window) if window else False)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(n, -1)
