"""The one list of compute-shader variants: :data:`VARIANTS`, each a name, the ``.comp`` it is built from,
its ``#define``s and its binding count.

Two readers: ``shaders/build.py`` compiles each variant to ``shaders/spv/<name>.spv`` (committed), and the
runtime registers each as a kernel (:data:`hmad.backends.vulkan.registry.KERNELS`, which adds the push
struct and workgroup size of its source). A test holds that every registered kernel has a committed
``.spv`` and every ``.spv`` a variant (tests/test_vulkan_variants.py).

This module imports nothing but the standard library: ``python3 shaders/build.py`` loads it by path,
without numpy, vulkan or the ``hmad`` package. The parameter lists below (head dims per lane, layouts,
weight types, ...) are what the variants are built for; the kernel modules read them from here.
"""

from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
    """One SPIR-V variant: ``shaders/spv/<name>.spv`` built from ``shaders/<source>`` with ``defines``; its
    shader declares storage buffers 0..n_buffers-1 (checked against the SPIR-V when the kernel is built)."""

    name: str
    source: str
    defines: dict[str, str]
    n_buffers: int


# -- what the variants are built for --------------------------------------------------------------------
#: the define of the variants that read their large inputs as storage texel buffers (suffix ``_texel``)
TEXEL = {"TEXEL_LOADS": "1"}
#: KV pool element types: name suffix, defines
POOLS = (("f32", {}), ("f16", {"POOL_TYPE": "float16_t"}))
ATTENTION_DECODE_DPL = (4, 8, 32)  # attention_decode.comp: head dims per lane (Dh <= DPL * subgroup size)
ATTENTION_DECODE_GROUPS = (4, 8)  # ... and query heads per KV head it holds registers for
ATTENTION_DECODE_KL_GROUPS = (2, 4)  # attention_decode_kl.comp (8 lanes per key, Dh <= 128): query heads
ATTENTION_ONE_LANE_GROUPS = (1, 2, 4)  # attention_split_l1.comp: query heads its arrays hold (more: slices)
ATTENTION_PREFILL_DPL = (8, 16, 32)  # attention_prefill.comp: head dims per lane (Dh <= 8 DPL)
ATTENTION_PREFILL_CM_DH = (64, 128, 256)  # attention_prefill_cm.comp: the head dims it is built for
#: vision_attention.comp: head sizes with a variant of their own (Gemma 3's SigLIP: 72), and the most the
#: run-time-sized variant takes (a multiple of 4)
VISION_ATTENTION_DH = (16, 32, 64, 72, 128)
VISION_ATTENTION_MAX_DH = 256
#: vision_attention_cm.comp: the padded head sizes it is built for (multiples of 16; Gemma 3's 72 takes 80)
VISION_ATTENTION_CM_DH = (32, 64, 80, 96, 128)
#: block types of embed_dq.comp (embed.comp reads f32, f16 and q8_0 tables itself)
EMBED_DQ_TYPES = ("bf16", "q4_0", "q5_0", "q4_k", "q6_k")
#: weight types with a decoder in dequant.glsl (mul_mat.comp, mul_mat_reg.comp)
MATMUL_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k")
#: float weight types of mul_mat_vec.comp
FLOAT_MATVEC_TYPES = ("f32", "f16", "bf16")
#: weight types with a unit decoder in dq_int8.glsl (mul_mat_vec_unit.comp, mul_mat_vec_q8.comp)
UNIT_TYPE_NAMES = ("q8_0", "q4_0", "q5_0", "q4_k", "q6_k")
#: weight types of the cooperative-matrix mat-mat (float16 tiles: not F32/BF16, whose range float16 lacks)
COOPMAT_TYPE_NAMES = ("f16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k")
#: float mat-vec variants per type (mul_mat_vec_unit.comp): up to 8 tokens or one, plain or fused GeGLU
UNIT_VARIANTS = (
    ("", {}),
    ("_geglu", {"GEGLU": "1"}),
    ("_t1", {"MAX_T": "1u"}),
    ("_geglu_t1", {"GEGLU": "1", "MAX_T": "1u"}),
)
#: layouts of the int8 mat-vec (mul_mat_vec_q8.comp): name suffix -> (NR rows per lane group, KS lane
#: groups per row group, splitting the rows' K between them); built for T <= 8 tokens, and the
#: Q8_T1_LAYOUTS for one token too (``_t1``)
Q8_LAYOUTS = {
    "": (2, 1),
    "_k2": (2, 2),
    "_r4": (4, 1),
    "_r4k2": (4, 2),
    "_l4": (4, 1),
    "_l8": (8, 1),
    "_l16": (16, 1),
}
Q8_T1_LAYOUTS = ("", "_k2", "_l4", "_l8", "_l16")
#: layouts whose lane groups are not 32 lanes wide: "_l4", "_l8" and "_l16", one invocation per 4, 8 or 16
#: rows (each its rows' whole K, no reduction across lanes): for CPU implementations, whose SIMD runs
#: invocations side by side (kernels_q8.q8_matvec_layout)
Q8_LANES = {"_l4": 1, "_l8": 1, "_l16": 1}
#: layouts with GeGLU variants: NR 2, and the one-lane layouts that a GeGLU pair takes (at NR 4 and 8 tokens
#: the reduction would need 32.1 KiB of shared memory, over the 32 KiB lavapipe and some GPUs allow; the
#: one-lane layouts reduce nothing; "_l16" is for vocabulary-sized weights only)
Q8_GEGLU_LAYOUTS = ("", "_k2", "_l4", "_l8")
#: layouts built for some weight types only: "_l16" for the LM head types of the models hmad ships (the
#: embedded 270M's Q8_0 token embedding); other types' LM heads take "_l8"
Q8_LAYOUT_TYPES = {"_l16": ("q8_0",)}
#: fused tails of the one-token int8 mat-vec (in the Q8_T1_LAYOUTS): suffix -> (the variant it extends,
#: defines, bindings). "_t1_qo" (GeGLU): its output's q8 form for the down projection (XQ, XD, N / 32
#: counters, y again)
Q8_TAILS = {"_t1_qo": ("_geglu", {"GEGLU": "1", "QOUT": "1"}, 9)}
#: (BT tokens, BN rows) of mul_mm_coopmat.comp built for every COOPMAT type (the first layout)
COOPMAT_TILES = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 128))
#: the Q4_K-only layouts of mul_mm_coopmat.comp: (BT, BN, SG_T, SG_N subgroups along tokens and rows, BK,
#: two tile sets, W pieces: 0, 1 (16 quant bytes) or 2 (a whole 64-weight chunk)); why each is built:
#: kernels_coopmat.py
COOPMAT_Q4K_VARIANTS = (
    (128, 128, 2, 2, 64, False, 0),
    (128, 128, 2, 2, 32, True, 0),
    (64, 128, 2, 2, 64, False, 0),
    (128, 128, 2, 4, 32, True, 0),
    (256, 128, 4, 2, 32, False, 0),
    (128, 256, 2, 4, 32, False, 0),
    (128, 128, 2, 2, 32, False, 0),
    (32, 128, 2, 4, 64, False, 1),
    (16, 128, 1, 4, 64, False, 1),
    (128, 128, 2, 2, 64, False, 1),
    (64, 128, 2, 2, 64, False, 1),
    (128, 128, 2, 2, 64, False, 2),
    (64, 128, 2, 2, 64, False, 2),
    (32, 128, 2, 2, 64, False, 2),
    (32, 128, 1, 4, 64, False, 2),
    (16, 128, 1, 4, 64, False, 2),
    (32, 256, 1, 4, 64, False, 2),
)
#: the exact int8 cooperative-matrix GEMM (mul_mmq_coopmat.comp): (MR 16-row fragments a subgroup, NT token
#: fragments, MK the int8 product's K, JB blocks a store, NB tokens of a product: 16 or 8, FB: all MR
#: fragments' tiles stored together)
MMQ_LAYOUTS = (
    (2, 1, 32, 2, 16, True),
    (2, 1, 32, 2, 8, True),
    (2, 1, 16, 2, 16, True),
    (2, 1, 32, 2, 16, False),
    (1, 1, 32, 2, 8, False),
    (2, 1, 32, 4, 8, False),
    (2, 1, 32, 4, 8, True),
)
#: coopmat_peak.comp (bench_vulkan_coopmat_peak.py): (NA, NB) fragments a subgroup ...
COOPMAT_PEAK = ((2, 2), (2, 4), (4, 4))
#: ... and the staged variants of a4x4: fragments from shared memory, and the tile stored each step too
COOPMAT_PEAK_STAGED = (("_lds", {"LDS": "1"}), ("_step", {"LDS": "1", "STEP": "1"}))


# -- names of the parameterised variants ----------------------------------------------------------------
def coopmat_layout_variant(
    bt: int, bn: int, sg_t: int = 2, sg_n: int = 4, bk: int = 64, dbuf: bool = False, wide: int = 0
) -> tuple[str, dict[str, str]]:
    """(name suffix after the type, defines) of a mul_mm_coopmat layout: ``<BT>x<BN>`` for the first layout
    (2 x 4 subgroups, BK 64, one tile set), else ``<BT>x<BN>_s<SG_T>x<SG_N>`` then ``_bk32``, ``_db`` (two
    tile sets), ``_w`` or ``_w2`` (W pieces of 16 or 32 quant bytes) where they apply."""
    d = {"BT": f"{bt}u", "BN": f"{bn}u"}
    if (sg_t, sg_n, bk, dbuf, wide) == (2, 4, 64, False, 0):
        return f"{bt}x{bn}", d
    d |= {"SG_T": f"{sg_t}u", "SG_N": f"{sg_n}u"}
    d |= ({"BK32": "1"} if bk == 32 else {}) | ({"DBUF": "1"} if dbuf else {})
    d |= {"WIDE": str(wide)} if wide else {}
    tail = ("_bk32" if bk == 32 else "") + ("_db" if dbuf else "") + ("", "_w", "_w2")[wide]
    return f"{bt}x{bn}_s{sg_t}x{sg_n}" + tail, d


def q8_matvec_variants(t_name: str) -> list[tuple[str, dict[str, str]]]:
    """(name suffix after the type, defines) of every int8 mat-vec variant of weight type ``t_name``:
    [_geglu] layout [_t1]."""
    out = []
    for lay in (lay for lay in Q8_LAYOUTS if t_name in Q8_LAYOUT_TYPES.get(lay, (t_name,))):
        d = _q8_defines(lay)
        for geglu, g in (("", {}), ("_geglu", {"GEGLU": "1"}))[: 2 if lay in Q8_GEGLU_LAYOUTS else 1]:
            out.append((f"{geglu}{lay}", {**g, **d}))
            if lay in Q8_T1_LAYOUTS:
                out.append((f"{geglu}{lay}_t1", {**g, **d, "MAX_T": "1u"}))
    return out


def _q8_defines(lay: str) -> dict[str, str]:
    """The defines of int8 mat-vec layout ``lay`` (none for the default)."""
    if not lay:
        return {}
    nr, ks = Q8_LAYOUTS[lay]
    lanes = {"ONE_LANE": "1"} if Q8_LANES.get(lay) == 1 else {}
    return {"NR": f"{nr}u", "KS": f"{ks}u", **lanes}


def q8_tail_variants() -> list[tuple[str, dict[str, str], int]]:
    """(name suffix after the type, defines, bindings) of the int8 mat-vec variants with a fused tail."""
    out = []
    for lay in (lay for lay in Q8_T1_LAYOUTS if lay not in Q8_LANES):  # a tail's rows must divide 32
        d = _q8_defines(lay)
        for suffix, (base, extra, n_buffers) in Q8_TAILS.items():
            out.append((f"{base}{lay}{suffix}", {**d, **extra, "MAX_T": "1u"}, n_buffers))
    return out


def mmq_kernel_name(mr: int, nt: int, mk: int, jb: int, nb: int = 16, fb: bool = False) -> str:
    """``mul_mmq_coopmat_q4_k_m<MR>n<NT>k<MK>j<JB>[_n8][_fb]``"""
    return (
        f"mul_mmq_coopmat_q4_k_m{mr}n{nt}k{mk}j{jb}" + ("" if nb == 16 else f"_n{nb}") + ("_fb" if fb else "")
    )


# -- the list ---------------------------------------------------------------------------------------------
def _v(name: str, source: str, n_buffers: int, **defines: str) -> Variant:
    return Variant(name, source, defines, n_buffers)


def _elementwise() -> list[Variant]:
    """Copies, norms, the embedding gather, RoPE, GeGLU and the KV write."""
    return [
        _v("copy_vec4", "copy.comp", 2),
        _v("copy_vec4_x4", "copy.comp", 2, UNROLL="4"),
        _v("copy_vec4_x8", "copy.comp", 2, UNROLL="8"),
        _v("read_vec4", "read.comp", 2),
        _v("read_vec4_x4", "read.comp", 2, UNROLL="4"),
        _v("read_vec4_x8", "read.comp", 2, UNROLL="8"),
        _v("prefetch_vec4", "read.comp", 2, UNROLL="4", PREFETCH="1"),
        _v("add_f32", "add.comp", 3),
        _v("rms_norm_f32", "rms_norm.comp", 3),
        _v("rms_norm_f32_subgroup", "rms_norm.comp", 3, SUBGROUP="1"),
        _v("embed_f32", "embed.comp", 3),
        _v("embed_f16", "embed.comp", 3, TABLE_F16="1"),
        _v("embed_q8_0", "embed.comp", 3, TABLE_Q8_0="1"),
        *[Variant(f"embed_{t}", "embed_dq.comp", {f"TYPE_{t.upper()}": "1"}, 3) for t in EMBED_DQ_TYPES],
        # the forward pass's embedding: rows given as input embeddings (an image's soft tokens) too
        _v("embed_f32_in", "embed.comp", 4, INPUT_EMBEDS="1"),
        _v("embed_f16_in", "embed.comp", 4, TABLE_F16="1", INPUT_EMBEDS="1"),
        _v("embed_q8_0_in", "embed.comp", 4, TABLE_Q8_0="1", INPUT_EMBEDS="1"),
        *[
            Variant(f"embed_{t}_in", "embed_dq.comp", {f"TYPE_{t.upper()}": "1", "INPUT_EMBEDS": "1"}, 4)
            for t in EMBED_DQ_TYPES
        ],
        _v("rope_f32", "rope.comp", 3),
        _v("geglu_f32", "geglu.comp", 3),
        _v("kv_write_f32", "kv_write.comp", 5),
        _v("kv_write_f16", "kv_write.comp", 5, POOL_TYPE="float16_t"),
    ]


def _attention() -> list[Variant]:
    """Attention over the paged KV pool: split (decode and prefill kernels), then the reduce."""
    out = [Variant(f"attention_split_{p}", "attention_split.comp", d, 5) for p, d in POOLS]
    for pool, _ in POOLS:
        for mg in ATTENTION_ONE_LANE_GROUPS:
            defs = {"MAX_GROUP": f"{mg}u", **({"POOL_F16": "1"} if pool == "f16" else {})}
            out.append(Variant(f"attention_split_l1_{pool}_g{mg}", "attention_split_l1.comp", defs, 5))
    for pool, d in POOLS:
        for dpl in ATTENTION_DECODE_DPL:
            for mg in ATTENTION_DECODE_GROUPS:
                defs = {"DPL": f"{dpl}u", "MAX_GROUP": f"{mg}u", "KU": "4u" if dpl == 4 else "1u", **d}
                out.append(
                    Variant(f"attention_decode_{pool}_dpl{dpl}_g{mg}", "attention_decode.comp", defs, 5)
                )
    for pool, d in POOLS:
        for mg in ATTENTION_DECODE_KL_GROUPS:
            defs = {"MAX_GROUP": f"{mg}u", **d}
            out.append(Variant(f"attention_decode_kl_{pool}_g{mg}", "attention_decode_kl.comp", defs, 5))
    out.append(_v("attention_decode_kl_f32_g2_l4", "attention_decode_kl.comp", 5, MAX_GROUP="2u", LANES="4u"))
    for pool, d in POOLS:
        for dpl in ATTENTION_PREFILL_DPL:
            defs = {"DPL": f"{dpl}u", **d}
            out.append(Variant(f"attention_prefill_{pool}_dpl{dpl}", "attention_prefill.comp", defs, 5))
    for pool, d in POOLS:
        for dh in ATTENTION_PREFILL_CM_DH:
            defs = {"DH": f"{dh}u", **d}
            out.append(Variant(f"attention_prefill_cm_{pool}_d{dh}", "attention_prefill_cm.comp", defs, 5))
    return out + [
        _v("attention_reduce_f32", "attention_reduce.comp", 2),
        _v("attention_reduce_f32_q8", "attention_reduce.comp", 4, Q8OUT="1"),
        _v("attention_reduce_f32_x3", "attention_reduce.comp", 4, Q8OUT="1", PLANES="3"),
    ]


def _tails() -> list[Variant]:
    """Readback tails (argmax, top-k, log-sum-exp, a given token's logit, sampling, token feed, logit
    adjustments), fused norms and activation quantizers."""
    return [
        _v("argmax_f32", "argmax.comp", 2),
        _v("argmax_chunks_f32", "argmax.comp", 3, CHUNKS="1"),  # logits, ids, values
        _v("argmax_merge_f32", "argmax.comp", 3, MERGE="1"),  # values, ids, the chunks' ids
        _v("feed_tokens", "feed_tokens.comp", 2),
        _v("logit_bias", "logit_bias.comp", 2),  # logits, the step's entries
        _v("sample_topk", "sample_topk.comp", 4),
        _v("topk_f32", "topk.comp", 3),
        _v("topk_merge_f32", "topk.comp", 4, FROM_CANDIDATES="1"),  # values, ids, vals, the candidates' ids
        _v("row_lse_f32", "row_lse.comp", 2),  # logits, each row's log-sum-exp
        _v("row_lse_chunks_f32", "row_lse.comp", 3, CHUNKS="1"),  # logits, each chunk's max and sum
        _v("row_lse_merge_f32", "row_lse.comp", 3, MERGE="1"),  # the chunks' maxima, lse, their sums
        _v("row_gather_f32", "row_gather.comp", 3),  # metadata (targets), logits, each row's target logit
        _v("norm_rope_f32", "norm_rope.comp", 4),
        _v("norm_rope_kv_f32", "norm_rope_kv.comp", 9),
        _v("norm_rope_kv_f16", "norm_rope_kv.comp", 9, POOL_TYPE="float16_t"),
        _v("quantize_q8", "quantize_q8.comp", 3),
        _v("quantize_x3", "quantize_q8.comp", 3, PLANES="3"),
        _v("residual_norm", "residual_norm.comp", 4),
        _v("residual_norm_next", "residual_norm.comp", 6, NEXT="1"),
        _v("residual_norm_next_q8", "residual_norm.comp", 8, NEXT="1", Q8OUT="1"),
        _v("residual_norm_next_x3", "residual_norm.comp", 8, NEXT="1", Q8OUT="1", PLANES="3"),
        # ... and h's row scales and float16 copy for the cooperative-matrix GEMM (row_scale.comp's), alone
        # or beside the q8 form
        _v("residual_norm_next_xh", "residual_norm.comp", 8, NEXT="1", XHOUT="1"),
        _v("residual_norm_next_q8_xh", "residual_norm.comp", 10, NEXT="1", Q8OUT="1", XHOUT="1"),
        _v("residual_norm_next_x3_xh", "residual_norm.comp", 10, NEXT="1", Q8OUT="1", PLANES="3", XHOUT="1"),
    ]


def _matvec() -> list[Variant]:
    """Mat-vecs (up to 8 tokens): int8 over q8 activations, one plane (q8x) or three (x3: the exact path);
    float of float weights (shared memory or subgroup reduce); float of quantized weights by units. A
    ``_geglu`` variant also binds W_up, after the others."""
    out = []
    for x, planes in (("q8x", {}), ("x3", {"PLANES": "3"})):
        for t in UNIT_TYPE_NAMES:
            tails = [(s, d, 4 + ("_geglu" in s)) for s, d in q8_matvec_variants(t)] + q8_tail_variants()
            for suffix, extra, n_buffers in tails:
                defs = {f"TYPE_{t.upper()}": "1", **planes, **extra}
                out.append(Variant(f"mul_mat_vec_{x}_{t}{suffix}", "mul_mat_vec_q8.comp", defs, n_buffers))
    for t in FLOAT_MATVEC_TYPES:
        for suffix, extra in (("", {}), ("_subgroup", {"SUBGROUP": "1"})):
            defs = {f"TYPE_{t.upper()}": "1", **extra}
            out.append(Variant(f"mul_mat_vec_{t}{suffix}", "mul_mat_vec.comp", defs, 3))
    for t in UNIT_TYPE_NAMES:
        for suffix, extra in UNIT_VARIANTS:
            defs = {f"TYPE_{t.upper()}": "1", **extra}
            n_buffers = 3 + ("_geglu" in suffix)
            out.append(Variant(f"mul_mat_vec_{t}{suffix}", "mul_mat_vec_unit.comp", defs, n_buffers))
    return out


def _matmat() -> list[Variant]:
    """Mat-mats (any token count): tiled and register-tiled of every type; cooperative-matrix per type and
    token tile, and the Q4_K-only layouts; the cooperative-matrix peak; the exact int8 GEMM; the K-split
    reductions and row scales they use."""
    out = [
        Variant(f"mul_mat{reg}_{t}", src, {f"TYPE_{t.upper()}": "1"}, 3)
        for reg, src in (("", "mul_mat.comp"), ("_reg", "mul_mat_reg.comp"))
        for t in MATMUL_TYPE_NAMES
    ]
    out += [  # W and x through storage texel buffers (CPU implementations: physical.texel_loads)
        Variant(f"mul_mat_reg_{t}_texel", "mul_mat_reg.comp", {f"TYPE_{t.upper()}": "1", **TEXEL}, 3)
        for t in MATMUL_TYPE_NAMES
    ]
    for t in COOPMAT_TYPE_NAMES:
        for bt, bn in COOPMAT_TILES:
            suffix, d = coopmat_layout_variant(bt, bn)
            defs = {f"TYPE_{t.upper()}": "1", **d}
            out.append(Variant(f"mul_mm_coopmat_{t}_{suffix}", "mul_mm_coopmat.comp", defs, 4))
    for lay in COOPMAT_Q4K_VARIANTS:
        suffix, d = coopmat_layout_variant(*lay)
        out.append(
            Variant(f"mul_mm_coopmat_q4_k_{suffix}", "mul_mm_coopmat.comp", {"TYPE_Q4_K": "1", **d}, 4)
        )
    for na, nb in COOPMAT_PEAK:
        out.append(_v(f"coopmat_peak_a{na}x{nb}", "coopmat_peak.comp", 3, NA=f"{na}u", NB=f"{nb}u"))
    for suffix, d in COOPMAT_PEAK_STAGED:
        out.append(
            Variant(f"coopmat_peak_a4x4{suffix}", "coopmat_peak.comp", {"NA": "4u", "NB": "4u", **d}, 3)
        )
    for mr, nt, mk, jb, nb, fb in MMQ_LAYOUTS:
        defs = {"MR": f"{mr}u", "NT": f"{nt}u", "MK": f"{mk}u", "JB": f"{jb}u", "NB": f"{nb}u"}
        defs |= {"FB": "1"} if fb else {}
        out.append(Variant(mmq_kernel_name(mr, nt, mk, jb, nb, fb), "mul_mmq_coopmat.comp", defs, 4))
    return out + [
        _v("split_reduce", "split_reduce.comp", 2),
        _v("split_reduce_geglu", "split_reduce.comp", 3, GEGLU="1"),  # gate, y, up
        _v("row_scale", "row_scale.comp", 3),
        _v("geglu_row_scale", "geglu_row_scale.comp", 4),  # gate, s, up, xh
    ]


def _vision() -> list[Variant]:
    """The vision encoder's kernels (backends/vulkan/vision*.py): its GEMM per weight type and layout, row
    norms, elementwise ops, im2col, average pool, and the dense attention per head size (VISION_ATTENTION_DH,
    and one that reads the head size at run time; on cooperative matrices per padded head size,
    VISION_ATTENTION_CM_DH)."""
    out = [
        Variant(f"vision_{op}_{t}", "vision_linear.comp", {**d, **ds}, 4)
        for op, d in (("linear", {}), ("matmul", {"W_KN": "1"}))
        for t, ds in (("f32", {}), ("f16", {"W_F16": "1"}))
    ]
    out += [
        _v("vision_layer_norm", "vision_norm.comp", 4),
        _v("vision_rms_norm", "vision_norm.comp", 3, RMS="1"),
        _v("vision_add", "vision_eltwise.comp", 3, ADD="1"),
        _v("vision_add3", "vision_eltwise.comp", 4, ADD3="1"),
        _v("vision_gelu", "vision_eltwise.comp", 2, GELU="1"),
        _v("vision_bias_gelu", "vision_eltwise.comp", 3, GELU="1", BIAS="1"),
        _v("vision_im2col", "vision_im2col.comp", 2),
        _v("vision_pool", "vision_pool.comp", 2),
    ]
    out += [
        _v(f"vision_attention_dh{dh}", "vision_attention.comp", 7, DH=f"{dh}u", EXACT="1")
        for dh in VISION_ATTENTION_DH
    ]
    out += [
        _v(f"vision_attention_cm_d{dh}", "vision_attention_cm.comp", 4, DH=f"{dh}u")
        for dh in VISION_ATTENTION_CM_DH
    ]
    out.append(_v("vision_qkv_f16", "vision_qkv_f16.comp", 9))
    return out + [
        _v("vision_attention_any", "vision_attention.comp", 7, DH=f"{VISION_ATTENTION_MAX_DH}u", KC="8u")
    ]


#: Every variant, in build order.
VARIANTS: tuple[Variant, ...] = (
    *_elementwise(),
    *_attention(),
    *_tails(),
    *_matvec(),
    *_matmat(),
    *_vision(),
)
