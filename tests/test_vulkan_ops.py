"""The non-matmul ops of the Gemma 3 forward pass as compute shaders, each against the numpy reference.

Every op runs on fresh random inputs with its output poisoned with NaN first, and is compared with
``CpuBackend(numerics="f32")`` (embed, rope, geglu, attention with its KV writes) or a direct numpy formula
(argmax). Needs a Vulkan device (lavapipe in CI); skipped with the reason when there is none. Small shapes.

Tolerances (float32 unless said):
- embed: exact (the same roundings: f16 -> f32 and Q8_0 d * q are exact or one f32 product, then * scale);
- rope: atol 4e-5 * (1 + position / 64) + rtol 1e-5: the angle is computed in float32 on the GPU
  (exp2 of the frequency exponent, pos * inv_freq), the reference does it in float64, so the error grows
  with the position (as llama.cpp's float32 angles do);
- geglu: |error| <= 4e-7 |gate * up| + 2e-6 |y|: the GPU writes 0.5 (1 + tanh u) as 1 / (1 + exp(-2u)); for
  negative gates the reference's 1 + tanh(u) cancels, so both sit ~1.6e-7 |gate * up| from the float64 value;
- kv_write: exact (float32 copy, or the same float16 rounding as numpy's astype);
- attention: rtol 2e-5, atol 2e-6 (online softmax in a different summation order);
- argmax: exact ids, ties to the lowest id;
- topk: exact ids and values, in sampling.py's order (value desc, equal values lowest id first, NaN as -inf).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_vulkan_fused import q8_reference
from vk_harness import assert_x3_planes, run

from hmad.backends.cpu import CpuBackend, CpuWeight
from hmad.backends.vulkan.shapes import ATTENTION_ONE_LANE_BLOCK
from hmad.backends.vulkan.stepmeta import NONE, StepMetaLayout, kv_slots
from hmad.backends.vulkan.variants import ATTENTION_DECODE_DPL
from hmad.core.batch import SAMPLE_DTYPE, SeqSlice, StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.core.quants import quantize_q8_0, random_blocks
from hmad.core.tensors import QType, WeightTensor
from hmad.engine.sampling import Sampler, SamplingParams

REF = CpuBackend(numerics="f32")


# -- step metadata (no device) -------------------------------------------------------------------------------
def _batch(block_size=4):
    """Three sequences: A prefills 5 more positions after 37 cached, B decodes at 9, C starts a prompt."""
    rng = np.random.default_rng(11)
    glob = rng.permutation(32).astype(np.int32)  # scattered global blocks
    loc = rng.permutation(12).astype(np.int32)  # rings of 4 blocks
    parts = [
        (SeqSlice(7, 0, 0, 37, glob[:11], loc[:4]), rng.integers(0, 300, 5), True),
        (SeqSlice(8, 0, 0, 9, glob[11:14], loc[4:8]), rng.integers(0, 300, 1), True),
        (SeqSlice(9, 0, 0, 0, glob[14:15], loc[8:9]), rng.integers(0, 300, 3), False),
    ]
    return StepBatch.build(parts, block_size)


def test_step_meta_layout_and_pack():
    b = _batch()
    lay = StepMetaLayout(max_tokens=b.n_tokens + 2, max_seqs=4, max_table=40)
    m = lay.pack(b)
    t, tmax = b.n_tokens, lay.max_tokens
    assert m.dtype == np.uint32 and len(m) == lay.words == lay.tables + 40
    assert list(m[:4]) == [t, 3, 4, 2]
    assert np.array_equal(m[lay.tokens : lay.tokens + t], b.tokens)
    assert np.array_equal(m[lay.positions : lay.positions + t], b.positions)
    assert list(m[lay.seq : lay.seq + tmax]) == [0] * 5 + [1] + [2] * 3 + [NONE] * 2
    for sec, info, table_of in (
        (lay.slot_global, lay.info_global, lambda s: s.global_table),
        (lay.slot_local, lay.info_local, lambda s: s.local_table),
    ):
        assert list(m[sec + t : sec + tmax]) == [NONE] * 2
        for i, s in enumerate(b.seqs):
            start, n = m[info + 2 * i : info + 2 * i + 2]
            assert np.array_equal(m[start : start + n], table_of(s))
            want = kv_slots(table_of(s), np.arange(s.pos0, s.end_pos), 4)
            assert np.array_equal(m[sec + s.start : sec + s.start + s.n], want)
    assert list(m[lay.logit_rows : lay.logit_rows + 2]) == list(b.logit_rows)
    # into a reused buffer (the mapped one holds an earlier step's words, maybe another bucket's): the same
    # words as into zeros, up to the end of the tables this step uses (B's decode row: the integer path)
    dirty = np.full(lay.words, 0xDEADBEEF, np.uint32)
    used = lay.tables + sum(len(s.global_table) + len(s.local_table) for s in b.seqs)
    assert np.array_equal(lay.pack(b, out=dirty)[:used], m[:used])
    with pytest.raises(ValueError, match="exceeds the bucket"):
        StepMetaLayout(max_tokens=4, max_seqs=4, max_table=40).pack(b)
    assert lay.max_tiles == 0 and not m[lay.tiled : lay.tiled + tmax].any()


def test_step_meta_tiles():
    """Sequences with at least tile_min_rows rows in the step go in tiles of up to 32 rows: A's 45 rows as
    32 + 13, D's 10; B (1 row) and C (3) stay per-row. Unused tile entries are zeros."""
    from hmad.backends.vulkan.stepmeta import TILE_ROWS

    b = _prefill_batch(4, 22)
    lay = StepMetaLayout(max_tokens=64, max_seqs=4, max_table=200, tile_min_rows=8)
    assert TILE_ROWS == 32 and lay.max_tiles == 64 // 32 + 64 // 8
    m = lay.pack(b)
    tiles = m[lay.tiles : lay.tiles + 3 * lay.max_tiles].reshape(-1, 3)
    assert tiles[:3].tolist() == [[0, 0, 32], [0, 32, 13], [3, 49, 10]] and not tiles[3:].any()
    assert m[lay.tiled : lay.tiled + 64].tolist() == [1] * 45 + [0] * 4 + [1] * 10 + [0] * 5
    assert lay.feed == lay.tiles + 3 * lay.max_tiles  # then the feed rows, sampling, the block tables
    assert lay.sample == lay.feed + lay.max_tokens and lay.tables == lay.sample + 5 * lay.max_seqs


def _fed_batch():
    """_batch() with B's decode token fed from row 1 of the step before (engine.pipeline)."""
    b = _batch()
    parts = [(s, b.tokens[s.start : s.start + s.n], True) for s in b.seqs]
    return StepBatch.build(parts, 4, feed=[-1, 1, -1])


def test_step_meta_feed_rows():
    """A fed row's feed word is 1 + its source row; every other row's is 0 (into a dirty buffer too)."""
    b = _fed_batch()
    assert b.feed.tolist() == [-1] * 5 + [1] + [-1] * 3
    lay = StepMetaLayout(max_tokens=b.n_tokens + 2, max_seqs=4, max_table=40)
    m = lay.pack(b, out=np.full(lay.words, 0xDEADBEEF, np.uint32))
    assert m[lay.feed : lay.feed + lay.max_tokens].tolist() == [0] * 5 + [2] + [0] * 5
    assert StepBatch.build([(s, [0] * s.n, True) for s in _batch().seqs], 4, feed=[-1] * 3).feed is None


# -- embed ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("table_type", ["f32", "f16", "q8_0"])
def test_embed_matches_reference(dev, kernels, gpu, table_type):
    from hmad.backends.vulkan.push import EmbedPush

    rng = np.random.default_rng(5)
    vocab, dim, split = 300, 96, 128
    f32 = rng.standard_normal((vocab, dim)).astype(np.float32)
    if table_type == "q8_0":
        data, qtype = quantize_q8_0(f32), QType.Q8_0
    else:
        data = f32.astype(np.float16) if table_type == "f16" else f32
        qtype = QType.F16 if table_type == "f16" else QType.F32
    row_bytes = data.nbytes // vocab
    tokens = np.array([3, 299, 0, 128, 127, 42, 3, 200], np.uint32)
    ids = np.concatenate([np.full(5, 7, np.uint32), tokens])  # token 0's id at ids_off = 5
    scale = float(np.sqrt(dim))
    want = REF.embed(CpuWeight(WeightTensor("t", qtype, (vocab, dim), data), True), tokens, scale)

    b_ids, b_tab = gpu.put(ids), gpu.put(data)
    b_y = gpu.poison(gpu.alloc(len(tokens) * dim * 4))
    k = kernels(f"embed_{table_type}")
    # the table bound as two ranges of whole rows, one dispatch each (as for one > maxStorageBufferRange)
    ranges = [(0, split), (split, vocab - split)]
    run(
        dev,
        *[
            (
                k,
                [b_ids, (b_tab, r0 * row_bytes, n * row_bytes), b_y],
                EmbedPush(len(tokens), dim, 5, r0, n, dim, scale),
                k.groups_for(len(tokens)),
            )
            for r0, n in ranges
        ],
    )
    np.testing.assert_array_equal(gpu.get(b_y, shape=(len(tokens), dim)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("table_type", ["bf16", "q4_0", "q5_0", "q4_k", "q6_k"])
def test_embed_block_types_match_gguf(dev, kernels, gpu, table_type):
    """embed_dq.comp gathers rows of a table in its file's block type; the reference dequantizes with the
    gguf package (independent of hmad's decoders). dq8 may fuse a product into an FMA: one float32
    rounding of a weight, times the scale."""
    from gguf import GGMLQuantizationType, quants

    from hmad.backends.vulkan.push import EmbedDqPush

    rng = np.random.default_rng(11)
    vocab, dim, split = 300, 512, 128
    qtype = QType[table_type.upper()]
    data = random_blocks(qtype, (vocab, dim), rng)
    row_bytes = data.nbytes // vocab
    raw = data.view(np.uint8).reshape(vocab, -1)  # gguf takes the bytes of a row for every type
    ref_table = quants.dequantize(raw, GGMLQuantizationType[table_type.upper()]).astype(np.float32)
    tokens = np.array([3, 299, 0, 128, 127, 42, 3, 200], np.uint32)
    ids = np.concatenate([np.full(5, 7, np.uint32), tokens])
    scale = float(np.sqrt(dim))
    want = ref_table[tokens] * np.float32(scale)

    b_tab, b_ids = gpu.put(np.ascontiguousarray(data)), gpu.put(ids)
    b_y = gpu.poison(gpu.alloc(len(tokens) * dim * 4))
    k = kernels(f"embed_{table_type}")
    ranges = [(0, split), (split, vocab - split)]  # two ranges of whole rows, one dispatch each
    run(
        dev,
        *[
            (
                k,
                [(b_tab, r0 * row_bytes, n * row_bytes), b_ids, b_y],
                EmbedDqPush(len(tokens), dim, 5, r0, n, dim, row_bytes, scale),
                k.groups_for(len(tokens)),
            )
            for r0, n in ranges
        ],
    )
    got = gpu.get(b_y, shape=(len(tokens), dim))
    tol = 2 * np.finfo(np.float32).eps * np.abs(want).max() + 1e-30
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


# -- rope ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("base,scale", [(10_000.0, 1.0), (1_000_000.0, 8.0)])
def test_rope_out_of_place_matches_reference(dev, kernels, gpu, base, scale):
    from hmad.backends.vulkan.push import RopePush

    rng = np.random.default_rng(int(base))
    t, h, dh = 6, 4, 64
    x = rng.standard_normal((t, h, dh)).astype(np.float32)
    pos = np.array([0, 1, 17, 255, 1000, 4095], np.uint32)
    want = REF.rope(x, pos, base, scale)
    b_x, b_pos = gpu.put(x), gpu.put(np.concatenate([np.zeros(3, np.uint32), pos]))
    b_y = gpu.poison(gpu.alloc(x.nbytes))
    k = kernels("rope_f32")
    run(dev, (k, [b_x, b_pos, b_y], RopePush(t, h, dh, h * dh, h * dh, 3, base, scale), 8))
    got = gpu.get(b_y, shape=(t, h, dh))
    atol = 4e-5 * (1 + pos.astype(np.float32) / 64)[:, None, None]
    assert np.all(np.abs(got - want) <= atol + 1e-5 * np.abs(want)), np.abs(got - want).max()
    np.testing.assert_array_equal(gpu.get(b_x, shape=x.shape), x)  # input untouched


@pytest.mark.gpu
def test_rope_in_place_on_the_q_part_of_fused_rows(dev, kernels, gpu):
    """Rotate heads 0..3 of rows holding 4 q heads then 2 k heads, in place; the k part stays as it was."""
    from hmad.backends.vulkan.push import RopePush

    rng = np.random.default_rng(9)
    t, h, hk, dh = 5, 4, 2, 32
    rows = rng.standard_normal((t, (h + hk) * dh)).astype(np.float32)
    pos = rng.integers(0, 300, t).astype(np.uint32)
    want = rows.copy()
    want[:, : h * dh] = REF.rope(rows[:, : h * dh].reshape(t, h, dh), pos, 10_000.0, 1.0).reshape(t, -1)
    b_rows, b_pos = gpu.put(rows), gpu.put(pos)
    k = kernels("rope_f32")
    stride = (h + hk) * dh
    run(dev, (k, [b_rows, b_pos, b_rows], RopePush(t, h, dh, stride, stride, 0, 10_000.0, 1.0), 4))
    np.testing.assert_allclose(gpu.get(b_rows, shape=rows.shape), want, rtol=1e-5, atol=2e-4)
    np.testing.assert_array_equal(gpu.get(b_rows, shape=rows.shape)[:, h * dh :], rows[:, h * dh :])


# -- geglu ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_geglu_on_fused_gate_up_rows_matches_reference(dev, kernels, gpu):
    from hmad.backends.vulkan.push import GegluPush

    rng = np.random.default_rng(3)
    t, f = 5, 1024  # f * 4 bytes: an aligned offset for the up half
    gu = (rng.standard_normal((t, 2 * f)) * 3).astype(np.float32)
    gu[0, :4] = [-60.0, 60.0, -1e6, 1e6]  # tanh saturation both ways
    gate, up = gu[:, :f], gu[:, f:]
    want = REF.geglu(gate, up)
    b_gu = gpu.put(gu)
    b_y = gpu.poison(gpu.alloc(t * f * 4))
    k = kernels("geglu_f32")
    # gate and up are the two halves of each row: bind the same buffer at two offsets
    halves = [(b_gu, 0, gu.nbytes - f * 4), (b_gu, f * 4, gu.nbytes - f * 4)]
    run(dev, (k, [*halves, b_y], GegluPush(f, t, 2 * f, 2 * f, f), 16))
    err = np.abs(gpu.get(b_y, shape=(t, f)) - want)
    assert np.all(err <= 4e-7 * np.abs(gate * up) + 2e-6 * np.abs(want)), err.max()


# -- kv_write + attention ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["f32", "f16"])
@pytest.mark.parametrize("head_dim", [32, 128, 256])
@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize(
    "variant,min_keys",
    [
        ("split", 32),
        ("split_l1", 32),
        ("split_l1_g1", 32),
        ("decode", 32),
        ("decode", 1),
        ("decode_kl", 32),
        ("decode_kl", 8),
        ("decode_kl4", 32),
    ],
)
def test_kv_write_and_paged_attention_match_reference(
    dev, kernels, gpu, pool, head_dim, splits, variant, min_keys
):
    """Two layers (global, sliding window 6) over three sequences of different lengths in one batch.

    Blocks of 4 positions, scattered; the local ring of 4 blocks wraps (sequence A is at 37..41); GQA of 4
    query heads over 2 KV heads; one padding row past the batch (zeros out, nothing written).
    ``splits`` per token and KV head of attention_split (then attention_reduce): one split of 3 tiles of 16
    keys, splits of 16 keys, mostly empty splits; ``variant`` "decode": attention_decode (the subgroup
    kernel, the variant the backend would pick for this device) in place of attention_split; "decode_kl":
    attention_decode_kl (8 lanes per key: 4 keys at once on a 32-wide subgroup, one on lavapipe's 8-wide
    ones; head dims up to 128); "decode_kl4": its 4-lane test variant, so that lavapipe's subgroups hold two
    keys and the merge of a subgroup's key clusters runs there too; "split_l1": attention_split_l1 (CPU
    implementations: an invocation per row, KV head, slice and split, 8 keys a chunk), with arrays for
    the 2 query heads a KV head; "split_l1_g1": arrays for 1, so each KV head's 2 heads go in 2 slices.
    ``min_keys``: the keys a split of the decode kernels takes at least (the backend's attention_min_keys;
    1: a split of a key or two, every split live; attention_split's splits take a tile of 16 keys whatever
    it says)."""
    from hmad.backends.vulkan.push import AttentionReducePush, AttentionSplitPush, KvWritePush

    rng = np.random.default_rng(head_dim)
    h, hkv, bs, window = 4, 2, 4, 6
    batch = _batch(bs)
    t = batch.n_tokens
    dtype = np.float16 if pool == "f16" else np.float32
    layout = KVLayout(bs, 32, 12, 4, (0,), (1,), hkv, head_dim)
    cpu = CpuBackend(numerics="f32", kv_dtype=np.dtype(dtype).name)
    cpu.alloc_kv(layout)
    for kp, vp in cpu.pools.values():  # history: every slot filled with random values
        kp[:] = rng.standard_normal(kp.shape).astype(dtype)
        vp[:] = rng.standard_normal(vp.shape).astype(dtype)
    init = {n: (kp[0].copy(), vp[0].copy()) for n, (kp, vp) in cpu.pools.items()}
    q = rng.standard_normal((t, h, head_dim)).astype(np.float32)
    k = rng.standard_normal((t, hkv, head_dim)).astype(np.float32)
    v = rng.standard_normal((t, hkv, head_dim)).astype(np.float32)
    scale = head_dim**-0.5

    lay = StepMetaLayout(max_tokens=t + 1, max_seqs=4, max_table=40)  # row t: padding
    pad = np.zeros((1, *q.shape[1:]), np.float32)
    b_meta = gpu.put(lay.pack(batch))
    b_q, b_k, b_v = (gpu.put(np.concatenate([a, pad[:, : a.shape[1]]])) for a in (q, k, v))
    kw = kernels(f"kv_write_{pool}")
    att_r = kernels("attention_reduce_f32")
    if variant == "decode":
        sub = dev.info.subgroup["size"]
        if not dev.caps["subgroup_arithmetic"]:
            pytest.skip("no subgroup arithmetic: the backend uses attention_split")
        dpl = next(d for d in ATTENTION_DECODE_DPL if head_dim <= d * sub)
        att_s = kernels(f"attention_decode_{pool}_dpl{dpl}_g4")  # G = 2 here
    elif variant.startswith("decode_kl"):
        lanes = 4 if variant == "decode_kl4" else 8
        if head_dim > 128 or not dev.caps["subgroup_shuffle"] or dev.info.subgroup["size"] % lanes:
            pytest.skip(f"attention_decode_kl: head dims up to 128, subgroup shuffles in clusters of {lanes}")
        if lanes == 4 and pool != "f32":
            pytest.skip("the 4-lane test variant is built for float32 pools")
        att_s = kernels(f"attention_decode_kl_{pool}_g2" + ("_l4" if lanes == 4 else ""))
    elif variant.startswith("split_l1"):
        att_s = kernels(f"attention_split_l1_{pool}_g" + ("1" if variant.endswith("g1") else "2"))
    else:
        att_s = kernels(f"attention_split_{pool}")
    per_group = ATTENTION_ONE_LANE_BLOCK if variant.startswith("split_l1") else 1  # items a workgroup
    slices = 2 if variant == "split_l1_g1" else 1  # items a (row, KV head, split)
    groups = att_s.groups_for(-(-(t + 1) * hkv * slices * splits // per_group))
    for layer, name, win in ((0, "global", None), (1, "local", window)):
        want = cpu.attention(q, k, v, layer, batch, win, scale)
        b_kp, b_vp = gpu.put(init[name][0]), gpu.put(init[name][1])
        b_o = gpu.poison(gpu.alloc((t + 1) * h * head_dim * 4))
        slot_off = lay.slot_global if name == "global" else lay.slot_local
        info_off = lay.info_global if name == "global" else lay.info_local
        row = hkv * head_dim
        write = KvWritePush(n_tokens=t + 1, row=row, k_stride=row, v_stride=row, slot_off=slot_off)
        split = AttentionSplitPush(
            n_tokens=t + 1,
            n_heads=h,
            n_kv_heads=hkv,
            head_dim=head_dim,
            q_stride=h * head_dim,
            n_splits=splits,
            block_size=bs,
            window=win or 0,
            pos_off=lay.positions,
            seq_off=lay.seq,
            info_off=info_off,
            scale=scale,
            min_keys=min_keys,
        )
        reduce = AttentionReducePush(t + 1, h, head_dim, splits, h * head_dim)
        b_part = gpu.poison(gpu.alloc((t + 1) * h * splits * (head_dim + 4) * 4))
        run(
            dev,
            (kw, [b_k, b_v, b_meta, b_kp, b_vp], write, 4),
            (att_s, [b_q, b_kp, b_vp, b_meta, b_part], split, groups),
            (att_r, [b_part, b_o], reduce, att_r.groups_for((t + 1) * h)),
        )
        got = gpu.get(b_o, shape=(t + 1, h * head_dim))
        np.testing.assert_allclose(got[:t], want, rtol=2e-5, atol=2e-6, err_msg=f"{name} layer")
        assert np.all(got[t] == 0)
        # the Q8OUT variant: the same o, and o quantized as the q8 reference does (test_vulkan_fused.py)
        att_q = kernels("attention_reduce_f32_q8")
        b_o2 = gpu.poison(gpu.alloc((t + 1) * h * head_dim * 4))
        b_oq, b_od = (
            gpu.poison(gpu.alloc((t + 1) * h * head_dim)),
            gpu.poison(gpu.alloc((t + 1) * h * head_dim // 4)),
        )
        run(dev, (att_q, [b_part, b_o2, b_oq, b_od], reduce, att_q.groups_for((t + 1) * h)))
        np.testing.assert_array_equal(gpu.get(b_o2, shape=got.shape), got)
        q_ref, d_ref, _ = q8_reference(got)
        oq = gpu.get_xq(b_oq, got.shape).astype(np.int32)
        assert np.abs(oq - q_ref).max() <= 1 and (oq != q_ref).mean() <= 1e-3
        np.testing.assert_allclose(gpu.get(b_od, np.float32, (t + 1, -1, 2))[..., 0], d_ref, rtol=1e-6)
        # ... and the three planes of the exact path
        att_x = kernels("attention_reduce_f32_x3")
        b_xq = gpu.poison(gpu.alloc(3 * (t + 1) * h * head_dim))
        run(dev, (att_x, [b_part, b_o2, b_xq, b_od], reduce, att_x.groups_for((t + 1) * h)))
        np.testing.assert_array_equal(gpu.get(b_o2, shape=got.shape), got)
        xq = gpu.get_xq(b_xq, (t + 1, 3, h * head_dim))
        assert_x3_planes(xq, gpu.get(b_od, np.float32, (t + 1, -1, 2)), got)
        kp_want, vp_want = cpu.pools[name][0][0], cpu.pools[name][1][0]
        np.testing.assert_array_equal(gpu.get(b_kp, dtype, kp_want.shape), kp_want)
        np.testing.assert_array_equal(gpu.get(b_vp, dtype, vp_want.shape), vp_want)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["f32", "f16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_one_lane_attention_over_long_rows(dev, kernels, gpu, pool, splits):
    """attention_split_l1 (a CPU implementation's kernel for every row) over splits of hundreds of keys: a
    row decoding at 700 and a 20-row prompt chunk at 300..319, GQA of 4 query heads on one KV head of 256
    values (the 270M's), a global layer and a 512-key window whose ring wraps, against the numpy backend."""
    from hmad.backends.vulkan.push import AttentionReducePush, AttentionSplitPush, KvWritePush

    rng = np.random.default_rng()
    h, hkv, dh, bs, window = 4, 1, 256, 16, 512
    ring = -(-(window + 20) // bs) + 1
    glob, loc = rng.permutation(96).astype(np.int32), rng.permutation(2 * ring).astype(np.int32)
    parts = [
        (SeqSlice(1, 0, 0, 700, glob[:45], loc[:ring]), rng.integers(0, 300, 1), True),
        (SeqSlice(2, 0, 0, 300, glob[45:66], loc[ring:]), rng.integers(0, 300, 20), True),
    ]
    batch = StepBatch.build(parts, bs)
    t = batch.n_tokens
    dtype = np.float16 if pool == "f16" else np.float32
    layout = KVLayout(bs, 96, 2 * ring, ring, (0,), (1,), hkv, dh)
    cpu = CpuBackend(numerics="f32", kv_dtype=np.dtype(dtype).name)
    cpu.alloc_kv(layout)
    for kp, vp in cpu.pools.values():
        kp[:] = rng.standard_normal(kp.shape).astype(dtype)
        vp[:] = rng.standard_normal(vp.shape).astype(dtype)
    init = {n: (kp[0].copy(), vp[0].copy()) for n, (kp, vp) in cpu.pools.items()}
    q, k, v = (rng.standard_normal((t, n, dh)).astype(np.float32) for n in (h, hkv, hkv))
    scale = dh**-0.5
    lay = StepMetaLayout(max_tokens=t, max_seqs=2, max_table=160)
    b_meta, b_q, b_k, b_v = gpu.put(lay.pack(batch)), gpu.put(q), gpu.put(k), gpu.put(v)
    att_s, att_r = kernels(f"attention_split_l1_{pool}_g4"), kernels("attention_reduce_f32")
    for layer, name, win in ((0, "global", None), (1, "local", window)):
        want = cpu.attention(q, k, v, layer, batch, win, scale)
        b_kp, b_vp = gpu.put(init[name][0]), gpu.put(init[name][1])
        slot_off = lay.slot_global if name == "global" else lay.slot_local
        info_off = lay.info_global if name == "global" else lay.info_local
        write = KvWritePush(n_tokens=t, row=dh, k_stride=dh, v_stride=dh, slot_off=slot_off)
        split = AttentionSplitPush(
            *(t, h, hkv, dh, h * dh, splits, bs, win or 0, lay.positions, lay.seq, info_off, scale)
        )
        b_part = gpu.poison(gpu.alloc(t * h * splits * (dh + 4) * 4))
        b_o = gpu.poison(gpu.alloc(t * h * dh * 4))
        groups = att_s.groups_for(-(-t * hkv * splits // ATTENTION_ONE_LANE_BLOCK))
        run(
            dev,
            (kernels(f"kv_write_{pool}"), [b_k, b_v, b_meta, b_kp, b_vp], write, 4),
            (att_s, [b_q, b_kp, b_vp, b_meta, b_part], split, groups),
            (att_r, [b_part, b_o], AttentionReducePush(t, h, dh, splits, h * dh), att_r.groups_for(t * h)),
        )
        got = gpu.get(b_o, shape=(t, h * dh))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"{name} layer")


def _prefill_batch(block_size, ring):
    """A prefills 45 rows after 37 cached (two tiles: 32 + 13), B decodes at 9, C starts a 3-row prompt (under
    the tile minimum of 8: per-row kernel), D prefills 10 rows after 20 (one tile)."""
    rng = np.random.default_rng(12)
    glob = rng.permutation(40).astype(np.int32)
    loc = rng.permutation(4 * ring).astype(np.int32)
    rings = [loc[i * ring : (i + 1) * ring] for i in range(4)]
    parts = [
        (SeqSlice(1, 0, 0, 37, glob[:21], rings[0]), rng.integers(0, 300, 45), True),
        (SeqSlice(2, 0, 0, 9, glob[21:24], rings[1]), rng.integers(0, 300, 1), True),
        (SeqSlice(3, 0, 0, 0, glob[24:25], rings[2]), rng.integers(0, 300, 3), False),
        (SeqSlice(4, 0, 0, 20, glob[25:33], rings[3]), rng.integers(0, 300, 10), True),
    ]
    return StepBatch.build(parts, block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["f32", "f16"])
@pytest.mark.parametrize(
    ("h", "hkv", "head_dim", "splits", "per_row"),
    [
        (4, 2, 128, 1, "split"),  # G 2 (the 27B's), 16 dims per lane
        (4, 1, 256, 3, "split"),  # G 4 (the 270M's), 32 dims per lane, 3 splits
        (8, 1, 32, 2, "decode"),  # G 8, 8 dims per lane (4 of them past Dh), the subgroup per-row kernel
        (2, 2, 64, 1, "split"),  # G 1: 32 rows a workgroup
    ],
)
@pytest.mark.parametrize("tiles", ["scalar", "cm", "cm_sharp"])
def test_prefill_tiles_and_per_row_kernels_match_reference(
    dev, kernels, gpu, pool, h, hkv, head_dim, splits, per_row, tiles
):
    """attention_prefill takes the rows of sequences with >= 8 rows in the step (tiles of up to 32 rows, each
    workgroup a sub-tile of 32 / G rows), the per-row kernel skips them (``tiled`` flags) and does the rest,
    both into one set of partials; attention_reduce combines them. Global layer and sliding windows of 6 and
    40 (under and over a sub-tile's span) on a ring of 22 blocks of 4; one padding row (zeros).
    ``cm``: the tiles on cooperative matrices (attention_prefill_cm: float16 q·scale, K, V and P), against
    the reference on the float16 values of q·scale, K and V (a power-of-two scale, so q·scale rounds alike);
    ``cm_sharp``: q 32x larger (scores spread ~30, against the kernel's TAU = 8), meant to move rows' maxima
    between chunks so that O's rows go through the lazy rescale (the test does not see whether it ran)."""
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable
    from hmad.backends.vulkan.push import (
        AttentionPrefillPush,
        AttentionReducePush,
        AttentionSplitPush,
        KvWritePush,
    )
    from hmad.backends.vulkan.recording import ATTENTION_TILE_MIN_ROWS
    from hmad.backends.vulkan.shapes import attention_prefill_groups
    from hmad.backends.vulkan.variants import ATTENTION_PREFILL_CM_DH

    if not dev.caps["subgroup_shuffle"] or dev.info.subgroup["size"] % 8:
        pytest.skip("no 8-lane subgroup shuffles: the backend keeps the per-row kernels")
    cm = tiles != "scalar"
    if cm and not (coopmat_usable(dev.info) and head_dim in ATTENTION_PREFILL_CM_DH):
        pytest.skip("attention_prefill_cm: no float16 coopmat on 32-wide subgroups, or no variant for Dh")
    rng = np.random.default_rng(head_dim + h)
    bs, ring = 4, 22
    batch = _prefill_batch(bs, ring)
    t = batch.n_tokens
    dtype = np.float16 if pool == "f16" or cm else np.float32  # cm: float16 values in either pool
    layout = KVLayout(bs, 40, 4 * ring, ring, (0,), (1, 2), hkv, head_dim)
    cpu = CpuBackend(numerics="f32", kv_dtype="float16" if pool == "f16" else "float32")
    cpu.alloc_kv(layout)
    for kp, vp in cpu.pools.values():
        kp[:] = rng.standard_normal(kp.shape).astype(dtype)
        vp[:] = rng.standard_normal(vp.shape).astype(dtype)
    init = {n: (kp.copy(), vp.copy()) for n, (kp, vp) in cpu.pools.items()}
    q, k, v = (rng.standard_normal((t, n, head_dim)).astype(dtype).astype(np.float32) for n in (h, hkv, hkv))
    scale = 2.0 ** -round(np.log2(head_dim) / 2) if cm else head_dim**-0.5
    if tiles == "cm_sharp":
        q *= 32.0
    tol = {"rtol": 2e-3, "atol": 2e-3} if cm else {"rtol": 2e-5, "atol": 2e-6}  # cm: P in float16 (2^-11)
    lay = StepMetaLayout(t + 1, 4, 200, tile_min_rows=ATTENTION_TILE_MIN_ROWS)
    meta = lay.pack(batch)
    assert meta[lay.tiled : lay.tiled + t + 1].tolist() == [1] * 45 + [0] * 4 + [1] * 10 + [0]
    b_meta = gpu.put(meta)
    pad = np.zeros((1, h, head_dim), np.float32)
    b_q, b_k, b_v = (gpu.put(np.concatenate([a, pad[:, : a.shape[1]]])) for a in (q, k, v))
    if per_row == "decode":
        if not dev.caps["subgroup_arithmetic"]:
            pytest.skip("no subgroup arithmetic: the backend uses attention_split")
        dpl = next(d for d in ATTENTION_DECODE_DPL if head_dim <= d * dev.info.subgroup["size"])
        att_s = kernels(f"attention_decode_{pool}_dpl{dpl}_g8")
    else:
        att_s = kernels(f"attention_split_{pool}")
    if cm:
        att_p = kernels(f"attention_prefill_cm_{pool}_d{head_dim}")
    else:
        att_p = kernels(f"attention_prefill_{pool}_dpl{next(d for d in (8, 16, 32) if head_dim <= 8 * d)}")
    att_r, kw = kernels("attention_reduce_f32"), kernels(f"kv_write_{pool}")
    for layer, name, win in ((0, "global", None), (1, "local", 6), (2, "local", 40)):
        slot = layout.pool_of(layer)[1]
        want = cpu.attention(q, k, v, layer, batch, win, scale)
        b_kp, b_vp = gpu.put(init[name][0][slot]), gpu.put(init[name][1][slot])
        b_o = gpu.poison(gpu.alloc((t + 1) * h * head_dim * 4))
        b_part = gpu.poison(gpu.alloc((t + 1) * h * splits * (head_dim + 4) * 4))
        slot_off = lay.slot_global if name == "global" else lay.slot_local
        info_off = lay.info_global if name == "global" else lay.info_local
        row = hkv * head_dim
        common = (h, hkv, head_dim, h * head_dim, splits, bs, win or 0)
        split = AttentionSplitPush(t + 1, *common, lay.positions, lay.seq, info_off, scale, lay.tiled)
        tiles = AttentionPrefillPush(lay.max_tiles, *common, lay.positions, info_off, lay.tiles, scale)
        run(
            dev,
            (kw, [b_k, b_v, b_meta, b_kp, b_vp], KvWritePush(t + 1, row, row, row, slot_off), 4),
            (att_s, [b_q, b_kp, b_vp, b_meta, b_part], split, att_s.groups_for((t + 1) * hkv * splits)),
            (
                att_p,
                [b_q, b_kp, b_vp, b_meta, b_part],
                tiles,
                att_p.groups_for(attention_prefill_groups(lay.max_tiles, h // hkv, hkv, splits)),
            ),
            (
                att_r,
                [b_part, b_o],
                AttentionReducePush(t + 1, h, head_dim, splits, h * head_dim),
                att_r.groups_for((t + 1) * h),
            ),
        )
        got = gpu.get(b_o, shape=(t + 1, h * head_dim))
        np.testing.assert_allclose(got[:t], want, **tol, err_msg=f"{name} layer, window {win}")
        assert np.all(got[t] == 0)


# -- argmax --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [262_144, 4096, 1000, 200_001])  # one stage; the backend's; uneven chunks
def test_argmax_rows_of_a_full_vocabulary(dev, kernels, gpu, chunk):
    """argmax.comp as the backend records it: one stage when ``chunk`` >= V, else each chunk's best then
    theirs (argmax_chunks_f32, argmax_merge_f32); fresh rows, ties across chunks, NaN; outputs poisoned."""
    from hmad.backends.vulkan.push import ArgmaxPush

    rng = np.random.default_rng()
    s, vocab = 6, 262_144
    logits = rng.standard_normal((s, vocab)).astype(np.float32)
    logits[1, [5000, 200_000]] = 50.0  # a tie in two chunks: the lowest id wins
    logits[2] = 0.5  # all equal: id 0
    logits[3, [0, 17, vocab - 1]] = [np.nan, 80.0, np.nan]  # NaN never wins
    logits[4, : vocab - 1] = np.nan  # only the last column is a number
    logits[5] = np.nan  # a row of only NaN: 0xFFFFFFFF
    want = [int(np.argmax(logits[0])), 5000, 0, 17, vocab - 1, 0xFFFFFFFF]
    b_l = gpu.put(logits)
    b_ids = gpu.poison(gpu.alloc(4 * s))
    n = -(-vocab // chunk)
    if n == 1:
        k = kernels("argmax_f32")
        run(dev, (k, [b_l, b_ids], ArgmaxPush(s, vocab, vocab, vocab), k.groups_for(s)))
    else:
        first, merge = kernels("argmax_chunks_f32"), kernels("argmax_merge_f32")
        c_ids, c_vals = gpu.poison(gpu.alloc(4 * s * n)), gpu.poison(gpu.alloc(4 * s * n))
        run(
            dev,
            (first, [b_l, c_ids, c_vals], ArgmaxPush(s, vocab, vocab, chunk), first.groups_for(s * n)),
            (merge, [c_vals, b_ids, c_ids], ArgmaxPush(s, n, n, n), merge.groups_for(s)),
        )
    assert gpu.get(b_ids, np.uint32).tolist() == want


# -- feed_tokens -------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_feed_tokens_writes_the_fed_rows_from_the_ids(dev, kernels, gpu):
    """feed_tokens.comp on a packed step: the fed rows' tokens become the ids at their source rows (one of
    them outside the vocabulary: 0), every other word of the metadata unchanged; fresh random ids."""
    from hmad.backends.vulkan.push import FeedPush

    rng = np.random.default_rng(23)
    table, ring = np.arange(4, dtype=np.int32), np.zeros(0, np.int32)
    parts = [(SeqSlice(i, 0, 0, 10 + i, table, ring), [7 + i], True) for i in range(6)]  # six decode rows
    feed = [4, -1, 0, 5, -1, 2]
    b = StepBatch.build(parts, 4, feed=feed)
    lay = StepMetaLayout(max_tokens=8, max_seqs=8, max_table=64)
    m = lay.pack(b)
    ids = rng.integers(0, 300, 8).astype(np.uint32)
    ids[2] = 0xFFFFFFFF  # a row of only NaN
    b_m, b_ids = gpu.put(m), gpu.put(ids)
    k = kernels("feed_tokens")
    run(dev, (k, [b_m, b_ids], FeedPush(lay.tokens, lay.feed, lay.max_tokens, 300), k.groups_for(1)))
    want = m.copy()
    for row, f in enumerate(feed):
        if f >= 0:
            want[lay.tokens + row] = ids[f] if ids[f] < 300 else 0
    got = gpu.get(b_m, np.uint32)[: lay.words]
    assert np.array_equal(got, want) and got[lay.tokens + 5] == 0 and got[lay.tokens + 1] == 8


# -- sample_topk ---------------------------------------------------------------------------------------------
def _sampling_cases(rng, n: int) -> list[SamplingParams]:
    """Fresh sampling settings: greedy, and every filter alone and together (top_k 1 to 128)."""
    return [
        SamplingParams(
            temperature=0.0 if i % 8 == 0 else float(rng.choice([0.3, 0.7, 1.0, 1.6])),
            top_k=int(rng.choice([1, 2, 10, 40, 64, 128])),
            top_p=float(rng.choice([1.0, 1.0, 0.95, 0.8, 0.3])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
            seed=int(rng.integers(2**63)),
        )
        for i in range(n)
    ]


@pytest.mark.gpu
def test_sample_topk_draws_the_hosts_token(dev, kernels, gpu):
    """topk.comp then sample_topk.comp on fresh rows (peaked, flat-topped, tied, -inf masked) with fresh
    settings and each request's own next uniform: the token Sampler.sample_candidates draws from the same
    candidates and uniform. Greedy rows always; sampled rows but at rounding edges (the device sums in
    float32, the host in float64): at most 1 % of them may differ (the scheduler redoes those: a test of
    test_vulkan_backend). The ids are poisoned first."""
    from hmad.backends.vulkan.push import SampleTopkPush, TopkPush

    rng = np.random.default_rng()
    s, vocab, k, rounds = 32, 4096, 128, 8
    topk, sample = kernels("topk_f32"), kernels("sample_topk")
    lay = StepMetaLayout(max_tokens=s, max_seqs=s, max_table=s)
    table, ring = np.zeros(1, np.int32), np.zeros(0, np.int32)
    differ = sampled = 0
    for _ in range(rounds):
        logits = (rng.standard_normal((s, vocab)) * rng.uniform(0.5, 6.0, (s, 1))).astype(np.float32)
        logits[1, rng.integers(0, vocab, 50)] = logits[1].max() + 1.0  # tied at the top
        logits[2, rng.integers(0, vocab, vocab // 2)] = -np.inf
        logits[3] = np.round(logits[3])  # many equal weights
        samplers = [Sampler(p) for p in _sampling_cases(rng, s)]
        sampling = np.zeros(s, SAMPLE_DTYPE)
        for i, sm in enumerate(samplers):
            p = sm.params
            sampling[i] = (p.temperature, p.top_k, p.top_p, p.min_p, sm.upcoming(0) if p.temperature else 0)
        parts = [(SeqSlice(i, 0, 0, 0, table, ring), [0], True) for i in range(s)]
        m = lay.pack(StepBatch.build(parts, 4, sampling=sampling))
        b_m, b_l = gpu.put(m), gpu.put(logits)
        b_i, b_v, b_out = gpu.alloc(4 * s * k), gpu.alloc(4 * s * k), gpu.poison(gpu.alloc(4 * s))
        run(
            dev,
            (topk, [b_l, b_i, b_v], TopkPush(s, vocab, vocab, k, vocab), topk.groups_for(s)),
            (sample, [b_m, b_i, b_v, b_out], SampleTopkPush(s, k, lay.sample), sample.groups_for(s)),
        )
        cids, cvals = gpu.get(b_i, np.uint32).reshape(s, k), gpu.get(b_v).reshape(s, k)
        got = gpu.get(b_out, np.uint32)
        for i, sm in enumerate(samplers):
            want = sm.sample_candidates(cids[i].astype(np.int64), cvals[i])
            if sm.params.temperature == 0:
                assert got[i] == want == int(np.argmax(logits[i])), f"greedy row {i}"
            else:
                sampled += 1
                differ += int(got[i] != want)
                assert got[i] in cids[i, : sm.params.top_k], f"row {i}: not a top-k candidate"
    assert differ <= sampled // 100, f"{differ} of {sampled} sampled rows differ from the host's draw"


# -- top-k ---------------------------------------------------------------------------------------------------
def _topk(dev, kernels, gpu, b_l, s: int, vocab: int, k: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """topk.comp on (s, vocab) logits as the backend records it (_record_topk): one stage when ``chunk`` >=
    vocab, else each chunk's best (topk_f32) then their best (topk_merge_f32). Every output poisoned first."""
    from hmad.backends.vulkan.push import TopkPush

    first, merge = kernels("topk_f32"), kernels("topk_merge_f32")
    b_i, b_v = gpu.poison(gpu.alloc(4 * s * k)), gpu.poison(gpu.alloc(4 * s * k))
    chunks = -(-vocab // chunk)
    if chunks == 1:
        run(dev, (first, [b_l, b_i, b_v], TopkPush(s, vocab, vocab, k, vocab), first.groups_for(s)))
    else:
        n = chunks * k
        c_i, c_v = gpu.poison(gpu.alloc(4 * s * n)), gpu.poison(gpu.alloc(4 * s * n))
        run(
            dev,
            (first, [b_l, c_i, c_v], TopkPush(s, vocab, vocab, k, chunk), first.groups_for(s * chunks)),
            (merge, [c_v, b_i, b_v, c_i], TopkPush(s, n, n, k, n), merge.groups_for(s)),
        )
    return gpu.get(b_i, np.uint32).reshape(s, k), gpu.get(b_v).reshape(s, k)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "vocab, chunk",
    [
        (262_144, 262_144),  # one stage
        (262_144, 4096),  # the backend's chunks for Gemma's vocabulary (topk_chunk)
        (262_144, 1000),  # a last chunk of 144 columns
        (5000, 1230),  # a last chunk shorter than k: its empty slots must never be picked
        (300, 100),  # chunks shorter than k
    ],
)
def test_topk_rows_of_a_full_vocabulary(dev, kernels, gpu, vocab, chunk):
    """topk.comp against a numpy lexsort on fresh rows: random, ties across the k-th boundary (more than k,
    spread over chunks), flat (all equal: ids 0..k-1), -inf masks, NaN, fewer finite values than k."""
    rng = np.random.default_rng()
    s, k = 5, 128
    logits = rng.standard_normal((s, vocab)).astype(np.float32)
    logits[1, rng.integers(0, vocab, 300)] = 3.75  # more ties than k at the top
    logits[2] = 0.5
    logits[3, rng.integers(0, vocab, vocab // 2)] = -np.inf
    logits[3, rng.integers(0, vocab, min(100, vocab // 4))] = np.nan
    logits[4, : vocab - 60] = -np.inf  # fewer finite values than k: the -inf ones fill, lowest ids first
    ids, vals = _topk(dev, kernels, gpu, gpu.put(logits), s, vocab, k, chunk)
    for r in range(s):
        key = np.where(np.isnan(logits[r]), -np.inf, logits[r])
        want = np.lexsort((np.arange(vocab), -key))[:k]
        assert ids[r].tolist() == want.tolist(), f"row {r}"
        np.testing.assert_array_equal(vals[r], logits[r, want])
