"""Attention, recorded: the KV-cache write (alone, or fused with the q/k norms and RoPE), the split-K passes
over the paged cache, the prefill tiles, and the reduce pass.

Functions of a :class:`~.context.RecordContext`. The kernels are policy.py's choice (attention_kernel,
prefill_kernel); the split count follows the options' workgroup targets (``attention_target``,
``attention_prefill_target``), or DETERMINISTIC_SPLITS in deterministic mode, where a row's split boundaries
then depend on its position (and visible entry) only. The reduce pass also writes its output as the int8
planes the output projection's mat-vec reads, where that takes it.
"""

from __future__ import annotations

from hmad.backends.vulkan import policy
from hmad.backends.vulkan.activations import Act
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.ops_norm import sums
from hmad.backends.vulkan.options import KV_DTYPES, VulkanOptions
from hmad.backends.vulkan.placement import VkWeight
from hmad.backends.vulkan.policy import ATTENTION_MAX_SPLITS, Q8_MAX_T
from hmad.backends.vulkan.push import (
    AttentionPrefillPush,
    AttentionReducePush,
    AttentionSplitPush,
    KvWritePush,
    NormRopeKvPush,
)
from hmad.backends.vulkan.shapes import (
    ATTENTION_ONE_LANE_BLOCK,
    ATTENTION_PREFILL_TILE,
    attention_prefill_groups,
)

# the attention kernels' limits: a head's values (a multiple of 4: vec4s) and query heads per KV head
ATTENTION_MAX_HEAD_DIM = 256
ATTENTION_MAX_GROUP = 8
# deterministic mode: the split count of every bucket (the partials are T x H x splits x (Dh + 4) floats: at
# 512 tokens of the 27B, 136 MB)
DETERMINISTIC_SPLITS = 16
# attention_split_l1 (CPU implementations): the most keys of one split (llvmpipe ends a shader's loops after
# 65,535 passes in all; the shader makes Dh / 2 a chunk of 8 keys, 128 at Dh 256: some 4,000 keys)
ONE_LANE_MAX_KEYS = 2048


def attention_limits(head_dim: int, group: int) -> str | None:
    """Why the attention kernels cannot take heads of ``head_dim`` values with ``group`` query heads per KV
    head, or None where they can."""
    if head_dim <= ATTENTION_MAX_HEAD_DIM and head_dim % 4 == 0 and group <= ATTENTION_MAX_GROUP:
        return None
    return (
        f"heads of {head_dim} values with {group} query heads per KV head; its attention kernels take "
        f"heads of at most {ATTENTION_MAX_HEAD_DIM} values (a multiple of 4) and at most "
        f"{ATTENTION_MAX_GROUP} query heads per KV head (the cpu backend runs any)"
    )


def attention(ctx: RecordContext, q: Act, k: Act, v: Act, layer: int, window: int | None, scale: float):
    """k, v (T, Hkv, Dh) into ``layer``'s cache (kv_write), then :func:`attend`."""
    t, hkv = k.shape[0], k.shape[1]
    pool, kp, vp, slot_off = ctx.kv_pool(layer)
    row = hkv * k.shape[2]
    write = KvWritePush(t, row, row, row, slot_off)
    pool_t, _ = KV_DTYPES[ctx.options.kv_dtype]
    ctx.dispatch(f"kv_write_{pool_t}", [k.view, v.view, ctx.meta_gpu, kp, vp], write, ctx.grid(t * row))
    return attend(ctx, q, hkv, layer, window, scale)


def normed_attention(
    ctx: RecordContext, q, k, v, wq: VkWeight, wk: VkWeight, eps: float, rope, layer: int, window, scale
) -> Act:
    """The q and k norms, RoPE and the cache write in one dispatch (norm_rope_kv.comp: three dispatches
    and a barrier fewer; q, k, v may be a GEMM's unsummed partial sums), then the attention passes."""
    (t, h, dh), hkv = q.shape, k.shape[1]
    assert wq.shape == wk.shape == (dh,), f"{wq.name}, {wk.name}: heads of {dh}"
    pool, kp, vp, slot_off = ctx.kv_pool(layer)
    qn = ctx.new(q.shape)
    (qv, qs), (kv, ks), (vv, vs) = (sums(a) for a in (q, k, v))  # values, or partial sums
    splits = (qs, ks, vs)
    push = NormRopeKvPush(t, h, hkv, dh, ctx.layout.positions, slot_off, *rope, eps, splits=splits)
    binds = [qv, kv, vv, wq.view, wk.view, ctx.meta_gpu, qn.view, kp, vp]
    ctx.dispatch(f"norm_rope_kv_{KV_DTYPES[ctx.options.kv_dtype][0]}", binds, push, t * (h + 2 * hkv))
    return attend(ctx, qn, hkv, layer, window, scale)


def attend(ctx: RecordContext, q: Act, hkv: int, layer: int, window: int | None, scale: float) -> Act:
    """Split-K attention of q (T, H, Dh) over ``layer``'s cache (this step's k, v written): pass 1 (with
    the prefill tiles in big buckets), then pass 2 (:func:`reduce_splits`). -> (T, H * Dh). Every pass-1
    kernel reads the metadata's ``visible`` section: a row sees up to its entry there (an image's soft
    tokens, their whole image), else its own position; the window counts back from its own position."""
    lay, meta, opt = ctx.kv_layout, ctx.layout, ctx.options
    t, h, dh = q.shape
    g = h // hkv
    assert attention_limits(dh, g) is None, attention_limits(dh, g)  # load_model refused such models
    pool, kp, vp, _ = ctx.kv_pool(layer)
    info_off = meta.info_global if pool == "global" else meta.info_local
    pool_t, _ = KV_DTYPES[opt.kv_dtype]
    tiles = policy.prefill_kernel(opt, ctx.caps, pool_t, dh, g) if meta.max_tiles else None
    one_lane = policy.attention_one_lane(ctx.caps)
    per_group = ATTENTION_ONE_LANE_BLOCK if one_lane else 1  # items a workgroup
    slices = -(-g // policy.attention_one_lane_heads(g)) if one_lane else 1  # items a (row, KV head, split)
    splits = attention_splits(opt, t, h, hkv * slices, bool(tiles), per_group)
    if one_lane:  # keys of a split bounded: the most a row of this layer can see
        splits = max(splits, one_lane_splits(window or lay.n_global_blocks * lay.block_size))
    part = ctx.new((t, h, splits, dh + 4))  # (m, l, padding, acc): shaders/attention_part.glsl
    binds = [q.view, kp, vp, ctx.meta_gpu, part.view]
    push = AttentionSplitPush(
        *(t, h, hkv, dh, h * dh, splits, lay.block_size, window or 0),
        *(meta.positions, meta.seq, info_off, scale, meta.tiled if tiles else 0, opt.attention_min_keys),
        meta.visible,
    )
    kern = policy.attention_kernel(opt, ctx.caps, pool_t, dh, g)
    ctx.dispatch(kern, binds, push, -(-t * hkv * slices * splits // per_group))
    if tiles:  # the tiles' rows (the kernel above skipped them), into the same partials
        push = AttentionPrefillPush(
            *(meta.max_tiles, h, hkv, dh, h * dh, splits, lay.block_size, window or 0),
            *(meta.positions, info_off, meta.tiles, scale, meta.visible),
        )
        ctx.dispatch(tiles, binds, push, attention_prefill_groups(meta.max_tiles, g, hkv, splits))
    return reduce_splits(ctx, part, t, h, dh, splits)


def attention_splits(opt: VulkanOptions, t: int, h: int, hkv: int, tiled: bool, per_group: int = 1) -> int:
    """Key splits per (row, KV head) of a step of ``t`` rows (``hkv``: a row's items, its KV heads times
    attention_split_l1's slices of their query heads): about ``attention_target`` workgroups at small
    batches, a workgroup ``per_group`` splits (attention_split_l1's invocations; a split takes at least
    min_keys keys, so splits past the sequence's length / min_keys exit at once; the partials stay
    ~attention_target * per_group * G * Dh floats). With prefill tiles (``tiled``), as many as
    the tiles want (a tile's workgroup per 32 query vectors and split, for about
    ``attention_prefill_target`` workgroups: the long causal rows of a prompt's last tiles spread).
    Deterministic mode: DETERMINISTIC_SPLITS (a row's split boundaries then depend on its position only)."""
    if opt.deterministic:
        return DETERMINISTIC_SPLITS
    splits = -(-opt.attention_target * per_group // (t * hkv))
    if tiled:
        splits = max(splits, -(-opt.attention_prefill_target // max(1, t * h // ATTENTION_PREFILL_TILE)))
    return max(1, min(ATTENTION_MAX_SPLITS, splits))


def one_lane_splits(keys: int) -> int:
    """The fewest splits of attention_split_l1 over rows of up to ``keys`` keys (ONE_LANE_MAX_KEYS a split,
    at most ATTENTION_MAX_SPLITS: 131,072 keys, Gemma 3's context, with room to spare up to the shader's
    ~3,400 a split); the same for every step of a process, so deterministic mode's split boundaries stay
    its position's."""
    return min(ATTENTION_MAX_SPLITS, -(-keys // ONE_LANE_MAX_KEYS))


def reduce_splits(ctx: RecordContext, part: Act, t: int, h: int, dh: int, splits: int) -> Act:
    """Pass 2: the splits' partials (T, H, splits, Dh + 4) merged -> (T, H * Dh), with its int8 planes for
    the output projection when the int8 mat-vec takes it."""
    opt = ctx.options
    o = ctx.new((t, h * dh))
    reduce = AttentionReducePush(t, h, dh, splits, h * dh)
    # the output projection's int8 input too (a head is whole q8 blocks; K % 64 == 0: XQ's order)
    planes = opt.planes
    if planes and (t <= Q8_MAX_T or opt.deterministic) and dh % 32 == 0 and h * dh % 64 == 0:
        o.q8 = ctx.new_q8(t, h * dh, planes)
        binds = [part.view, o.view, o.q8[0].view, o.q8[1].view]
        name = "attention_reduce_f32_x3" if planes == 3 else "attention_reduce_f32_q8"
        ctx.dispatch(name, binds, reduce, t * h)
    else:
        ctx.dispatch("attention_reduce_f32", [part.view, o.view], reduce, t * h)
    return o
