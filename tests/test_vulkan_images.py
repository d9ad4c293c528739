"""Image input on the Vulkan backend (issue 37): rows whose query sees past their own position
(``StepBatch.visible``: an image's soft tokens see their whole image) and rows whose input embedding is given
(``StepBatch.embeds``), in the recorded forward pass (stepmeta.py's ``visible`` and ``embed_src`` sections).

- Attention: each pass-1 kernel the policy can pick for a prefill row (attention_split, attention_decode,
  attention_decode_kl per row; the prefill tiles, scalar or on cooperative matrices, or none), on a global
  layer and sliding windows of 6 and 40, against ``CpuBackend(numerics="f32").attention`` (which
  test_image_spans.py checks against a dense mask); partials and outputs poisoned. Tolerance: rtol 2e-5,
  atol 2e-6 (test_vulkan_ops.py's: the online softmax sums in another order); the tiles on cooperative
  matrices 2e-3 (float16 P).
- The embedding gather's ``_in`` variants: given rows are exact copies of their vectors (read from the
  buffer's second half), the others the token rows (exact; Q4_K: within one float32 rounding).
- A tiny model: two sequences in a step, one with two images (random embeddings), then the same bucket
  without images, then the image step with other embeddings, then a small step (per-row kernels) reading
  the image rows' cached keys; every row's logits within 1e-4 of max |cpu| (test_vulkan_backend.py's RTOL;
  1e-2, its RTOL_INT8, where the device has float16 cooperative matrices). Then two image steps in flight at
  once (one per parity of the embeds buffer): their greedy ids equal the numpy backend's argmax.
- The tiny Gemma 3 VLM (test_vision_model.py's checkpoint, its images encoded on the device) in chunks:
  every position's logits within the same tolerance of transformers' (the fixture of test_vision_model.py).
Needs a Vulkan device (lavapipe in CI); skipped with the reason when there is none.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_vulkan_backend import close, rtol_for
from tiny_gguf import MIXED, make_tiny_gguf
from vk_harness import require_vulkan, run

from hmad.backends.cpu import CpuBackend, CpuWeight
from hmad.backends.vulkan.stepmeta import EMBEDS_ROW0, StepMetaLayout
from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.core.quants import quantize_q8_0, random_blocks
from hmad.core.tensors import QType, WeightTensor

REF = CpuBackend(numerics="f32")


def visible(spans: list[tuple[int, int]], pos0: int, n: int) -> np.ndarray:
    """Per position pos0..pos0+n-1, the last position it sees: its image's last, else its own (spans are
    (first position, soft tokens))."""
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    out = pos.copy()
    for s0, k in spans:
        out[(pos >= s0) & (pos < s0 + k)] = s0 + k - 1
    return out


# -- step metadata (no device) -------------------------------------------------------------------------------
def _image_batch(block_size: int, ring: int, images: bool = True) -> StepBatch:
    """A prefills 45 rows after 37 cached with images at 40..51 (in its first sub-tile), 60..75 (past its
    first tile) and 80..81 (ending the chunk); B decodes at 9; C starts a 3-row prompt with an image at 1..2
    (under the tile minimum: a per-row kernel's); D prefills 10 rows after 20 with an image at 22..27."""
    rng = np.random.default_rng(12)
    glob = rng.permutation(40).astype(np.int32)
    loc = rng.permutation(4 * ring).astype(np.int32)
    rings = [loc[i * ring : (i + 1) * ring] for i in range(4)]
    spec = [(37, 45, [(40, 12), (60, 16), (80, 2)], glob[:21]), (9, 1, [], glob[21:24])]
    spec += [(0, 3, [(1, 2)], glob[24:25]), (20, 10, [(22, 6)], glob[25:33])]
    parts = []
    for i, (pos0, n, spans, table) in enumerate(spec):
        vis = visible(spans, pos0, n) if images and spans else None
        s = SeqSlice(i, 0, 0, pos0, table, rings[i], visible=vis)
        parts.append((s, rng.integers(0, 300, n), True))
    return StepBatch.build(parts, block_size)


def test_step_meta_visible_and_embed_src():
    """visible: 1 + the last position a row sees (every row of a step with images); embed_src: 1 + the row's
    vector; both zeros in a step without (into a dirty buffer too); embeds_row0 is the launch's to write."""
    b = _image_batch(4, 22)
    b.embed_rows, b.embeds = np.array([3, 4, 58], np.int32), np.zeros((3, 8), np.float32)
    lay = StepMetaLayout(64, 4, 200, tile_min_rows=8)
    m = lay.pack(b, out=np.full(lay.words, 0xDEADBEEF, np.uint32))
    assert m[lay.visible : lay.visible + b.n_tokens].tolist() == (b.visible + 1).tolist()
    assert m[lay.visible + 3] == 52 and m[lay.visible + 23] == 76 and m[lay.visible + 47] == 3  # A, C
    assert not m[lay.visible + b.n_tokens : lay.visible + 64].any()
    src = m[lay.embed_src : lay.embed_src + 64]
    assert src[[3, 4, 58]].tolist() == [1, 2, 3] and np.count_nonzero(src) == 3
    assert m[EMBEDS_ROW0] == 0 and lay.tiled == lay.embed_src + 64 and lay.embed_src == lay.visible + 64
    plain = _image_batch(4, 22, images=False)
    m = lay.pack(plain, out=m)
    assert not m[lay.visible : lay.visible + 64].any() and not m[lay.embed_src : lay.embed_src + 64].any()


# -- attention -----------------------------------------------------------------------------------------------
PER_ROW = ["split", "decode", "decode_kl"]


def _per_row_kernel(dev, kernels, per_row: str, pool: str):
    from hmad.backends.vulkan.variants import ATTENTION_DECODE_DPL

    sub = dev.info.subgroup["size"]
    if per_row == "decode":
        if not dev.caps["subgroup_arithmetic"]:
            pytest.skip("no subgroup arithmetic: the backend uses attention_split")
        dpl = next(d for d in ATTENTION_DECODE_DPL if d * sub >= 64)
        return kernels(f"attention_decode_{pool}_dpl{dpl}_g4")  # G = 2 here
    if per_row == "decode_kl":
        if not dev.caps["subgroup_shuffle"] or sub % 8:
            pytest.skip("attention_decode_kl: subgroup shuffles in clusters of 8")
        return kernels(f"attention_decode_kl_{pool}_g2")
    return kernels(f"attention_split_{pool}")


def _tile_kernel(dev, kernels, tiles: str, pool: str):
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable

    if not dev.caps["subgroup_shuffle"] or dev.info.subgroup["size"] % 8:
        pytest.skip("no 8-lane subgroup shuffles: the backend keeps the per-row kernels")
    if tiles == "cm":
        if not coopmat_usable(dev.info):
            pytest.skip("attention_prefill_cm: no float16 cooperative matrices on 32-wide subgroups")
        return kernels(f"attention_prefill_cm_{pool}_d64")
    return kernels(f"attention_prefill_{pool}_dpl8")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("per_row", "tiles", "pool"),
    [(r, t, "f32") for r in PER_ROW for t in ("none", "scalar", "cm")] + [("split", "scalar", "f16")],
)
def test_attention_of_visible_rows_matches_reference(dev, kernels, gpu, per_row, tiles, pool):
    """_image_batch's rows through kv_write, the per-row kernel (and the tiles, which take A's and D's rows),
    attention_reduce; GQA 4 over 2 heads of 64; blocks of 4 scattered, a ring of 22 blocks; one padding row.
    The reference without the visible rows differs (so a kernel ignoring them fails)."""
    from hmad.backends.vulkan.push import (
        AttentionPrefillPush,
        AttentionReducePush,
        AttentionSplitPush,
        KvWritePush,
    )
    from hmad.backends.vulkan.shapes import attention_prefill_groups

    att_s = _per_row_kernel(dev, kernels, per_row, pool)
    att_p = None if tiles == "none" else _tile_kernel(dev, kernels, tiles, pool)
    cm = tiles == "cm"
    rng = np.random.default_rng()
    seed = rng.bit_generator.seed_seq.entropy
    h, hkv, dh, bs, ring, splits = 4, 2, 64, 4, 22, 3
    batch, plain = _image_batch(bs, ring), _image_batch(bs, ring, images=False)
    t = batch.n_tokens
    dtype = np.float16 if pool == "f16" or cm else np.float32  # cm: float16 values in either pool
    layout = KVLayout(bs, 40, 4 * ring, ring, (0,), (1, 2), hkv, dh)
    cpu = CpuBackend(numerics="f32", kv_dtype="float16" if pool == "f16" else "float32")
    cpu.alloc_kv(layout)
    for kp, vp in cpu.pools.values():  # history: every slot random
        kp[:] = rng.standard_normal(kp.shape).astype(dtype)
        vp[:] = rng.standard_normal(vp.shape).astype(dtype)
    init = {n: (kp.copy(), vp.copy()) for n, (kp, vp) in cpu.pools.items()}
    q, k, v = (rng.standard_normal((t, n, dh)).astype(dtype).astype(np.float32) for n in (h, hkv, hkv))
    scale = dh**-0.5  # a power of two: q * scale rounds alike in float16 (cm)
    tol = {"rtol": 2e-3, "atol": 2e-3} if cm else {"rtol": 2e-5, "atol": 2e-6}
    lay = StepMetaLayout(t + 1, 4, 200, tile_min_rows=8 if att_p else 0)
    b_meta = gpu.put(lay.pack(batch))
    pad = np.zeros((1, h, dh), np.float32)
    b_q, b_k, b_v = (gpu.put(np.concatenate([a, pad[:, : a.shape[1]]])) for a in (q, k, v))
    att_r, kw = kernels("attention_reduce_f32"), kernels(f"kv_write_{pool}")
    for layer, name, win in ((0, "global", None), (1, "local", 6), (2, "local", 40)):
        slot = layout.pool_of(layer)[1]
        want = cpu.attention(q, k, v, layer, batch, win, scale)
        causal = cpu.attention(q, k, v, layer, plain, win, scale)
        assert np.abs(want - causal).max() > 0.05, "the images change the reference"
        b_kp, b_vp = gpu.put(init[name][0][slot]), gpu.put(init[name][1][slot])
        b_o = gpu.poison(gpu.alloc((t + 1) * h * dh * 4))
        b_part = gpu.poison(gpu.alloc((t + 1) * h * splits * (dh + 4) * 4))
        slot_off = lay.slot_global if name == "global" else lay.slot_local
        info_off = lay.info_global if name == "global" else lay.info_local
        row = hkv * dh
        common = (h, hkv, dh, h * dh, splits, bs, win or 0)
        skip = lay.tiled if att_p else 0
        split = AttentionSplitPush(
            t + 1, *common, lay.positions, lay.seq, info_off, scale, skip, 8, lay.visible
        )
        binds = [b_q, b_kp, b_vp, b_meta, b_part]
        dispatches = [
            (kw, [b_k, b_v, b_meta, b_kp, b_vp], KvWritePush(t + 1, row, row, row, slot_off), 4),
            (att_s, binds, split, att_s.groups_for((t + 1) * hkv * splits)),
        ]
        if att_p:
            push = AttentionPrefillPush(
                lay.max_tiles, *common, lay.positions, info_off, lay.tiles, scale, lay.visible
            )
            groups = att_p.groups_for(attention_prefill_groups(lay.max_tiles, h // hkv, hkv, splits))
            dispatches.append((att_p, binds, push, groups))
        reduce = AttentionReducePush(t + 1, h, dh, splits, h * dh)
        dispatches.append((att_r, [b_part, b_o], reduce, att_r.groups_for((t + 1) * h)))
        run(dev, *dispatches)
        got = gpu.get(b_o, shape=(t + 1, h * dh))
        np.testing.assert_allclose(got[:t], want, **tol, err_msg=f"{name} layer, window {win}, seed {seed}")
        assert np.all(got[t] == 0)


# -- the embedding gather ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("table_type", ["f32", "q8_0", "q4_k"])
def test_embed_takes_the_given_rows_from_the_embeds_buffer(dev, kernels, gpu, table_type):
    """Rows 1, 4 and 6 of 8 are given (the step's vectors 0..2, in the buffer's second half: embeds_row0 5);
    the rest gather their token row times sqrt(D). The table in two ranges (one dispatch each); the other
    rows of the embeds buffer are NaN, so a wrong vector shows."""
    from gguf import GGMLQuantizationType, quants

    from hmad.backends.vulkan.push import EmbedDqPush, EmbedPush

    rng = np.random.default_rng()
    vocab, dim, split, cap = 300, 256, 128, 5
    qtype = QType[table_type.upper()]
    f32 = rng.standard_normal((vocab, dim)).astype(np.float32)
    data = {"f32": lambda: f32, "q8_0": lambda: quantize_q8_0(f32)}.get(table_type, lambda: None)()
    if data is None:
        data = random_blocks(qtype, (vocab, dim), rng)
    row_bytes = data.nbytes // vocab
    raw = data.view(np.uint8).reshape(vocab, -1)
    tokens = np.array([3, 299, 0, 128, 127, 42, 3, 200], np.uint32)
    scale = float(np.sqrt(dim))
    if table_type == "q4_k":  # dequantized by the gguf package (as test_vulkan_ops.py's embed_dq test)
        table = quants.dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32)
        want = table[tokens] * np.float32(scale)
    else:  # the numpy backend's gather
        want = REF.embed(CpuWeight(WeightTensor("t", qtype, (vocab, dim), data), True), tokens, scale)
    given = np.array([1, 4, 6])
    vectors = (8 * rng.standard_normal((3, dim))).astype(np.float32)
    meta = np.zeros(8 + 2 * len(tokens), np.uint32)  # header, tokens at 8, embed_src at 16
    meta[EMBEDS_ROW0], meta[8:16] = cap, tokens
    meta[16 + given] = [1, 2, 3]
    embeds = np.full((2 * cap, dim), np.nan, np.float32)
    embeds[cap : cap + 3] = vectors
    want = np.array(want, np.float32)
    want[given] = vectors

    b_tab, b_meta, b_emb = gpu.put(np.ascontiguousarray(data)), gpu.put(meta), gpu.put(embeds)
    b_y = gpu.poison(gpu.alloc(len(tokens) * dim * 4))
    k = kernels(f"embed_{table_type}_in")
    dispatches = []
    for r0, n in [(0, split), (split, vocab - split)]:
        rng_bind = (b_tab, r0 * row_bytes, n * row_bytes)
        if k.push_type is EmbedDqPush:
            push = EmbedDqPush(len(tokens), dim, 8, r0, n, dim, row_bytes, scale, 16, EMBEDS_ROW0)
            binds = [rng_bind, b_meta, b_y, b_emb]
        else:
            push = EmbedPush(len(tokens), dim, 8, r0, n, dim, scale, 16, EMBEDS_ROW0)
            binds = [b_meta, rng_bind, b_y, b_emb]
        dispatches.append((k, binds, push, k.groups_for(len(tokens))))
    run(dev, *dispatches)
    got = gpu.get(b_y, shape=(len(tokens), dim))
    np.testing.assert_array_equal(got[given], vectors)
    others = np.setdiff1d(np.arange(len(tokens)), given)
    tol = 0 if table_type != "q4_k" else 2 * np.finfo(np.float32).eps * np.abs(want).max()
    np.testing.assert_allclose(got[others], want[others], rtol=0, atol=tol)


# -- the whole forward pass ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vulkan_device():
    require_vulkan()


@pytest.fixture(scope="module")
def pair(vulkan_device, tmp_path_factory):
    """(cpu model, vulkan model) of one tiny mixed-type GGUF (D 256, window 8, Q8_0 embedding), defaults."""
    from hmad.composition import load_model

    path = make_tiny_gguf(tmp_path_factory.mktemp("vkimg") / "tiny.gguf", seed=5, types=MIXED)
    cpu, vk = load_model(path, "cpu", numerics="f32"), load_model(path, "vulkan")
    yield cpu, vk
    vk.backend.close()


class Steps:
    """Batches of both models over one KV layout and the same block tables (sequences A 0, B 1, C 2)."""

    def __init__(self, pair, rng):
        from hmad.engine.kvcache import KVCacheManager

        self.cpu, self.vk = pair
        self.rng, self.d = rng, self.cpu.config.d_model
        cfg = self.cpu.config
        self.layout = KVLayout.plan(cfg, max_tokens=128, max_seqs=3, max_chunk=64, block_size=4)
        for m in pair:
            m.backend.alloc_kv(self.layout)
        self.kv = KVCacheManager(self.layout)
        for sid, n in enumerate((72, 21, 16)):
            self.kv.reserve(sid, n)

    def part(self, sid: int, pos0: int, n: int, spans=(), embeds=None):
        """Sequence ``sid``'s n rows from pos0 (random tokens), its images at ``spans`` with ``embeds`` (one
        vector a soft token) or random ones."""
        b = self.kv.tables(sid)
        s = SeqSlice(sid, 0, 0, pos0, b.global_table, b.local_table)
        if spans:
            s.visible = visible(list(spans), pos0, n)
            rows = np.concatenate([np.arange(s0 - pos0, s0 - pos0 + k) for s0, k in spans]).astype(np.int32)
            vals = embeds if embeds is not None else self.vectors(len(rows))
            s.embeds = (rows, vals)
        return (s, self.rng.integers(6, self.cpu.config.vocab_size, n).tolist(), True)

    def vectors(self, n: int) -> np.ndarray:
        """Random soft tokens, of the scaled token embeddings' size (0.5 sqrt(D))."""
        return (0.5 * np.sqrt(self.d) * self.rng.standard_normal((n, self.d))).astype(np.float32)

    def batch(self, parts, all_rows: bool = True) -> StepBatch:
        b = StepBatch.build(parts, self.layout.block_size)
        if all_rows:
            b.logit_rows = np.arange(b.n_tokens, dtype=np.int32)
        return b


@pytest.mark.gpu
def test_forward_with_images_matches_cpu_and_replays_without_stale_rows(pair):
    """Step 1 (bucket 128, tiles): A's 48 rows with images at 4..19 and 30..37, B's 20 text rows. Step 2:
    the same positions, text only (embed_src and visible all zeros again). Step 3: step 1's rows with other
    vectors. Step 4 (bucket 16, per-row kernels): A's 12 rows from 48 with an image at 50..57 (reading the
    cached image rows of step 3), B's decode row. Every row's logits against the numpy backend's."""
    cpu, vk = pair
    st = Steps(pair, np.random.default_rng())
    rtol = rtol_for(vk)
    spans = [(4, 16), (30, 8)]
    b1 = st.part(1, 0, 20)
    steps = [
        [st.part(0, 0, 48, spans), b1],
        [st.part(0, 0, 48), st.part(1, 0, 20)],
        [st.part(0, 0, 48, spans, st.vectors(24)), b1],
        [st.part(0, 48, 12, [(50, 8)]), st.part(1, 20, 1)],
    ]
    wants = []
    for parts in steps:
        wants.append(cpu.forward(st.batch(parts)))
        close(vk.forward(st.batch(parts)), wants[-1], rtol)
    assert np.abs(wants[2] - wants[0]).max() > 0.1 * np.abs(wants[0]).max()  # other vectors, other logits
    assert {t for t, _ in vk.backend.graphs} >= {128, 16}


@pytest.mark.gpu
def test_two_image_steps_in_flight_take_their_own_vectors(pair):
    """C's 16-row prompt with an image at 2..9 launched, then A's 12-row prompt with an image at 3..10
    launched (the other parity) before the first is collected: each reads its own half of the embeds
    buffer. Every row's greedy id equals the numpy backend's argmax where its top two logits are apart by
    more than the tolerance."""
    cpu, vk = pair
    st = Steps(pair, np.random.default_rng())
    rtol = rtol_for(vk)
    x_parts, y_parts = [st.part(2, 0, 16, [(2, 8)])], [st.part(0, 0, 12, [(3, 8)])]
    be = vk.backend
    first = be.launch_greedy(be.run(vk.net, st.batch(x_parts)))
    second = be.launch_greedy(be.run(vk.net, st.batch(y_parts)))
    assert first.parity != second.parity
    got = [be.collect(first), be.collect(second)]
    for ids, parts in zip(got, (x_parts, y_parts), strict=True):
        logits = cpu.forward(st.batch(parts))
        top2 = np.sort(logits, -1)[:, -2:]
        sure = top2[:, 1] - top2[:, 0] > 2 * rtol * np.abs(logits).max()
        assert sure.any()
        assert ids[sure].tolist() == logits.argmax(-1)[sure].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("name, chunk", [("a", 7), ("b", 64), ("b", 9)])
def test_tiny_vlm_logits_match_transformers(vulkan_device, tmp_path, name, chunk):
    """The tiny Gemma 3 VLM (test_vision_model.py's: HF checkpoint, its images encoded on this device) fed in
    chunks the engine's rule allows: every position's logits within the tolerance above of transformers'
    with the image mask (tests/fixtures/hf_tiny_vlm_reference.npz)."""
    from test_vision_model import REF, logits_in_chunks, make_tiny_hf_checkpoint, spans_of

    from hmad.composition import load_model

    d = make_tiny_hf_checkpoint(tmp_path, seed=int(REF["seed"]), multimodal=True, vision="real")
    vlm = load_model(d, "vulkan")
    try:
        prompt = REF[f"prompt_{name}"].tolist()
        pixels = REF["pixels_0"][:1] if name == "a" else REF["pixels_1"]
        ours = logits_in_chunks(vlm, prompt, spans_of(prompt, vlm.encode_images(pixels)), chunk)
        close(ours, REF[f"logits_{name}"], rtol_for(vlm))
    finally:
        vlm.backend.close()
