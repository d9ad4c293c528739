#version 450
// One layer's attention inputs in one dispatch (three dispatches and a barrier -> one): Gemma's per-head
// norm + RoPE of q and k (norm_rope.glsl, as norm_rope.comp), and this step's k and v rows written into the
// layer's paged KV pools (as kv_write.comp: row t to slot meta[slot_off + t], padding rows' slot 0xFFFFFFFF
// write nothing; the normed, rotated k is what the cache holds). One workgroup per (token, head) of
//   [0, T H): query head -> qo;  [T H, T (H + Hkv)): key head -> k_pool;  then T Hkv value heads -> v_pool.
// q, k and v may each come as the K-split partial sums of the GEMM that made it (push q_splits, k_splits,
// v_splits > 1: split s of (T, ...) at s T H Dh or s T Hkv Dh), added as they are read, in split order as
// split_reduce.comp adds them, bit for bit: its three dispatches fewer, and q, k, v not written and read back.
// A head's q or k values are summed once, into shared memory, for both the norm and the rotation.
// Requires Dh <= MAX_HEAD_DIM.
// Bindings: 0 q (T, H, Dh), 1 k (T, Hkv, Dh), 2 v, 3 wq (Dh), 4 wk (Dh), 5 step metadata, 6 qo (T, H, Dh),
// 7 k_pool, 8 v_pool (slots, Hkv, Dh) of POOL_TYPE (float, or float16_t for a float16 cache).
#include "common.glsl"
#extension GL_KHR_shader_subgroup_arithmetic : require
#ifndef POOL_TYPE
#define POOL_TYPE float
#endif

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer K { float k[]; };
layout(binding = 2) readonly buffer V { float v[]; };
layout(binding = 3) readonly buffer WQ { float wq[]; };
layout(binding = 4) readonly buffer WK { float wk[]; };
layout(binding = 5) readonly buffer Meta { uint meta[]; };
layout(binding = 6) writeonly buffer QO { float qo[]; };
layout(binding = 7) writeonly buffer KP { POOL_TYPE k_pool[]; };
layout(binding = 8) writeonly buffer VP { POOL_TYPE v_pool[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv
    uint head_dim;    // Dh, even
    uint pos_off;     // meta sections (word offsets): positions, and the layer's cache slots
    uint slot_off;
    float base;
    float scale;
    float eps;
    uint q_splits;  // partial sums of q, k, v (1: the values)
    uint k_splits;
    uint v_splits;
} p;

// element i of q, k, v: their splits' partial sums added (common.glsl)
SPLIT_SUM_READER(float, q_at, q, p.q_splits, p.n_tokens * p.n_heads * p.head_dim)
SPLIT_SUM_READER(float, k_at, k, p.k_splits, p.n_tokens * p.n_kv_heads * p.head_dim)
SPLIT_SUM_READER(float, v_at, v, p.v_splits, p.n_tokens * p.n_kv_heads * p.head_dim)

#define MAX_HEAD_DIM 512u  // NormRopeKvPush.MAX_HEAD_DIM
shared float head[MAX_HEAD_DIM];  // the head's values, each summed once (head_inv_rms's barrier orders them)

#include "norm_rope.glsl"

void query_head(uint t, uint h, uint tid) {
    const uint half_dim = p.head_dim / 2u, o = (t * p.n_heads + h) * p.head_dim;
    float ss = 0.0;
    for (uint c = tid; c < p.head_dim; c += BLOCK_SIZE) {
        head[c] = q_at(o + c);
        ss += head[c] * head[c];
    }
    const float sc = head_inv_rms(ss);
    const float pos = float(meta[p.pos_off + t]);
    for (uint i = tid; i < half_dim; i += BLOCK_SIZE) {
        const float x0 = head[i] * sc * wq[i], x1 = head[i + half_dim] * sc * wq[i + half_dim];
        const vec2 r = rope_pair(x0, x1, rope_cos_sin(i, pos));
        qo[o + i] = r.x;
        qo[o + i + half_dim] = r.y;
    }
}

void key_head(uint t, uint h, uint tid) {
    const uint slot = meta[p.slot_off + t];
    if (slot == 0xFFFFFFFFu) return;  // uniform per workgroup
    const uint half_dim = p.head_dim / 2u, row = p.n_kv_heads * p.head_dim;
    const uint o = t * row + h * p.head_dim, so = slot * row + h * p.head_dim;
    float ss = 0.0;
    for (uint c = tid; c < p.head_dim; c += BLOCK_SIZE) {
        head[c] = k_at(o + c);
        ss += head[c] * head[c];
    }
    const float sc = head_inv_rms(ss);
    const float pos = float(meta[p.pos_off + t]);
    for (uint i = tid; i < half_dim; i += BLOCK_SIZE) {
        const float x0 = head[i] * sc * wk[i], x1 = head[i + half_dim] * sc * wk[i + half_dim];
        const vec2 r = rope_pair(x0, x1, rope_cos_sin(i, pos));
        k_pool[so + i] = POOL_TYPE(r.x);
        k_pool[so + i + half_dim] = POOL_TYPE(r.y);
    }
}

void value_head(uint t, uint h, uint tid) {
    const uint slot = meta[p.slot_off + t];
    if (slot == 0xFFFFFFFFu) return;
    const uint row = p.n_kv_heads * p.head_dim, o = t * row + h * p.head_dim, so = slot * row + h * p.head_dim;
    for (uint c = tid; c < p.head_dim; c += BLOCK_SIZE) v_pool[so + c] = POOL_TYPE(v_at(o + c));
}

void main() {
    uint g = group_index();
    const uint tid = gl_LocalInvocationID.x, nq = p.n_tokens * p.n_heads, nkv = p.n_tokens * p.n_kv_heads;
    if (g < nq) {
        query_head(g / p.n_heads, g % p.n_heads, tid);
    } else if (g < nq + nkv) {
        g -= nq;
        key_head(g / p.n_kv_heads, g % p.n_kv_heads, tid);
    } else if (g < nq + 2u * nkv) {
        g -= nq + nkv;
        value_head(g / p.n_kv_heads, g % p.n_kv_heads, tid);
    }
}
