#version 450
// Causal attention over the paged KV cache, pass 1 of 2, on subgroups: the same bindings, push constants,
// metadata and partial outputs (m, l, acc[Dh] per token, head and split) as attention_split.comp, which it
// replaces where the device has subgroup arithmetic (attention_reduce.comp is pass 2 for both).
//
// One workgroup per (token, KV head, split); split c covers per = max(ceil(len / n_splits), min_keys) keys of
// [lo, hi] (attention_split.comp). Inside, each subgroup takes every n-th key of the split on its own: lane l
// holds dims d = l + i * S (S the subgroup size, i < DPL) of the G query heads and of the key/value rows, the dot
// products are subgroupAdd reductions, and the online softmax (running max m, sum l, acc) lives in registers:
// no workgroup barrier inside the key loop. At the end the subgroups' states merge through shared memory
// (rescaled to the common max, added in subgroup order).
// Variants: DPL (4 or 8: 32-wide subgroups or wider; 32: 8-wide) x MAX_GROUP (4, 8): registers for G heads.
// KU keys per iteration: 4 with DPL 4, else 1 (with DPL 8, KU 4 measured slower: too many registers;
// docs/tuning.md).
// Host asserts: Dh <= DPL * S, G <= MAX_GROUP, BLOCK_SIZE / S <= MAX_SG.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_TYPE float
#endif
#ifndef DPL
#define DPL 8u
#endif
#ifndef MAX_GROUP
#define MAX_GROUP 8u
#endif
#ifndef KU
#define KU 1u  // keys per subgroup per iteration
#endif
#define MAX_SG 32u
#define MAX_HEAD_DIM 256u

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_TYPE k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_TYPE v_pool[]; };
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer Part { float part[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh
    uint q_stride;    // elements between tokens of q
    uint n_splits;
    uint block_size;  // B: positions per KV block
    uint window;      // 0: global; else the sliding window W
    uint pos_off;     // meta sections (word offsets)
    uint seq_off;
    uint info_off;
    float scale;
    uint skip_off;    // 0, or the meta section of per-row flags: rows flagged 1 are attention_prefill's
    uint min_keys;    // keys a split takes at least (a split past the row's length / min_keys is empty)
    uint vis_off;     // 0, or the meta section of per-row last visible keys (paged_kv.glsl: last_key)
} p;

#include "paged_kv.glsl"
#include "attention_part.glsl"


shared float s_m[MAX_SG * MAX_GROUP];
shared float s_l[MAX_SG * MAX_GROUP];
shared float s_acc[MAX_GROUP * MAX_HEAD_DIM];

void main() {
    const uint wg = group_index();
    const uint c = wg % p.n_splits;
    const uint rest = wg / p.n_splits;
    const uint kvh = rest % p.n_kv_heads, t = rest / p.n_kv_heads;
    if (t >= p.n_tokens) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x;
    const uint G = p.n_heads / p.n_kv_heads;
    const uint Dh = p.head_dim;
    const uint h0 = kvh * G;

    if (tiled_row(t)) return;  // a tile row: attention_prefill writes it
    uint c0, c1, tab, tab_len;
    split_keys(t, c, max(p.min_keys, 1u), c0, c1, tab, tab_len);
    if (c0 >= c1) {  // empty split or padding row: uniform per workgroup
        write_empty_partial(t, h0, c, G, tid);
        return;
    }
    const uint row = p.n_kv_heads * Dh, kvo = kvh * Dh, B = p.block_size;
    const uint S = gl_SubgroupSize, lane = gl_SubgroupInvocationID, sg = gl_SubgroupID, nsg = gl_NumSubgroups;

    float qr[MAX_GROUP][DPL], acc[MAX_GROUP][DPL], m[MAX_GROUP], l[MAX_GROUP];
    [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0;
        [[unroll]] for (uint i = 0; i < DPL; ++i) {
            const uint d = lane + i * S;
            qr[g][i] = g < G && d < Dh ? q[t * p.q_stride + (h0 + g) * Dh + d] * p.scale : 0.0;
            acc[g][i] = 0.0;
        }
    }
    // KU keys per iteration (j, j + nsg, ...): their loads are all issued before the first dot, so a subgroup
    // has KU rows of K and V in flight; one online-softmax update per head for the KU scores
    for (uint j = c0 + sg; j < c1; j += KU * nsg) {
        float kd[KU][DPL], vd[KU][DPL];
        [[unroll]] for (uint u = 0; u < KU; ++u) {
            const uint ju = j + u * nsg;
            const uint ko = kv_slot(tab, tab_len, min(ju, c1 - 1), B) * row + kvo;  // past c1: not loaded
            [[unroll]] for (uint i = 0; i < DPL; ++i) {
                const uint d = lane + i * S;
                kd[u][i] = d < Dh && ju < c1 ? float(k_pool[ko + d]) : 0.0;
                vd[u][i] = d < Dh && ju < c1 ? float(v_pool[ko + d]) : 0.0;
            }
        }
        [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
            if (g < G) {
                float sc[KU];
                float m_new = m[g];
                [[unroll]] for (uint u = 0; u < KU; ++u) {
                    float dot = 0.0;
                    [[unroll]] for (uint i = 0; i < DPL; ++i) dot += qr[g][i] * kd[u][i];
                    const float sd = subgroupAdd(dot);
                    sc[u] = j + u * nsg < c1 ? sd : NEG_INF;
                    m_new = max(m_new, sc[u]);
                }
                const float corr = exp(m[g] - m_new);
                l[g] *= corr;
                [[unroll]] for (uint i = 0; i < DPL; ++i) acc[g][i] *= corr;
                [[unroll]] for (uint u = 0; u < KU; ++u) {
                    const float w = exp(sc[u] - m_new);
                    l[g] += w;
                    [[unroll]] for (uint i = 0; i < DPL; ++i) acc[g][i] += w * vd[u][i];
                }
                m[g] = m_new;
            }
        }
    }
    // merge the subgroups: common max, then the rescaled sums added in subgroup order
    if (lane == 0u) {
        [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
            s_m[sg * MAX_GROUP + g] = m[g];
            s_l[sg * MAX_GROUP + g] = l[g];
        }
    }
    for (uint e = tid; e < G * Dh; e += BLOCK_SIZE) s_acc[e] = 0.0;
    barrier();
    float mx[MAX_GROUP], f[MAX_GROUP];
    [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
        mx[g] = NEG_INF;
        for (uint s = 0; s < nsg; ++s) mx[g] = max(mx[g], s_m[s * MAX_GROUP + g]);
        f[g] = m[g] == NEG_INF ? 0.0 : exp(m[g] - mx[g]);  // a subgroup without keys adds nothing
    }
    for (uint s = 0; s < nsg; ++s) {
        if (s == sg) {
            [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
                [[unroll]] for (uint i = 0; i < DPL; ++i) {
                    const uint d = lane + i * S;
                    if (g < G && d < Dh) s_acc[g * Dh + d] += f[g] * acc[g][i];
                }
            }
        }
        barrier();
    }
    for (uint e = tid; e < G * Dh; e += BLOCK_SIZE) {
        const uint g = e / Dh, d = e % Dh;
        part[part_base(t, h0 + g, c) + PART_ACC + d] = s_acc[e];
    }
    if (tid < G) {
        float lsum = 0.0;
        for (uint s = 0; s < nsg; ++s) {
            const float ms = s_m[s * MAX_GROUP + tid];
            lsum += ms == NEG_INF ? 0.0 : s_l[s * MAX_GROUP + tid] * exp(ms - mx[tid]);
        }
        const uint pb = part_base(t, h0 + tid, c);
        part[pb] = mx[tid];
        part[pb + 1] = lsum;
    }
}
