#version 450
// Causal attention over the paged KV cache, pass 1 of 2, with 8 lanes per key: the same bindings, push
// constants, metadata and partial outputs (m, l, acc[Dh] per token, head and split) as attention_split.comp and
// attention_decode.comp (attention_reduce.comp is pass 2 for all), for head dims up to 128.
//
// Why: attention_decode.comp spreads one key's dims over the whole subgroup, so every score is a
// subgroup-wide reduction (5 shuffle steps on 32 lanes) and every lane computes the same exp. Here a
// subgroup of S lanes takes S / 8 keys at once: the 8 lanes of a cluster hold vec4s v = l + 8 m (m < MV) of
// the key, a score is 3 shuffle steps within the cluster, and each cluster keeps its own online softmax
// (running max m, sum l, acc) for its keys. After the key loop the clusters of a subgroup merge through
// shuffles (rescaled to the common max), then the subgroups through shared memory, in subgroup order.
//
// One workgroup per (token, KV head, split), split c covering per = max(ceil(len / n_splits), min_keys) keys of
// [lo, hi] (as attention_decode). Key j of the split goes to subgroup ((j - c0) / (S / 8)) % n_sg, cluster
// (j - c0) % (S / 8); the loop is uniform per subgroup (clusters past the split's end score -inf).
// Variants: POOL_TYPE (float, float16_t) x MAX_GROUP (2, 4: registers for G query heads); LANES 4 for a
// test (the cluster merge on lavapipe's 8-wide subgroups). Host asserts:
// Dh % 4 == 0, Dh <= 128, G <= MAX_GROUP, subgroup size a multiple of LANES and BLOCK_SIZE / S <= MAX_SG.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_VEC vec4
#else
#define POOL_VEC f16vec4
#endif
#ifndef MAX_GROUP
#define MAX_GROUP 4u
#endif
#ifndef LANES
#define LANES 8u  // lanes per key (4: a test variant, so that lavapipe's 8-wide subgroups hold 2 keys)
#endif
#define MV (32u / LANES)  // vec4s per lane: Dh <= 4 * MV * LANES = 128
#define MAX_SG 32u
#define MAX_DV 32u  // vec4s of a head

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_VEC k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_VEC v_pool[]; };
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
shared vec4 s_acc[MAX_GROUP * MAX_DV];

// exp(a - mx), 0 for a = -inf (mx may be -inf too)
float rescale(float a, float mx) {
    return a == NEG_INF ? 0.0 : exp(a - mx);
}

void main() {
    const uint wg = group_index();
    const uint c = wg % p.n_splits;
    const uint rest = wg / p.n_splits;
    const uint kvh = rest % p.n_kv_heads, t = rest / p.n_kv_heads;
    if (t >= p.n_tokens) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x;
    const uint G = p.n_heads / p.n_kv_heads;
    const uint Dh = p.head_dim, DV = Dh / 4u;
    const uint h0 = kvh * G;

    if (tiled_row(t)) return;  // a tile row: attention_prefill writes it
    uint c0, c1, tab, tab_len;
    split_keys(t, c, max(p.min_keys, 1u), c0, c1, tab, tab_len);
    if (c0 >= c1) {  // empty split or padding row: uniform per workgroup
        write_empty_partial(t, h0, c, G, tid);
        return;
    }
    const uint row = p.n_kv_heads * DV, kvo = kvh * DV, B = p.block_size;  // in vec4s
    const uint S = gl_SubgroupSize, lane = gl_SubgroupInvocationID, sg = gl_SubgroupID, nsg = gl_NumSubgroups;
    const uint kl = lane % LANES, ks = lane / LANES, kps = S / LANES;  // lane in its key, key slot, keys/subgroup

    vec4 qr[MAX_GROUP][MV], acc[MAX_GROUP][MV];
    float m[MAX_GROUP], l[MAX_GROUP];
    [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0;
        [[unroll]] for (uint i = 0; i < MV; ++i) {
            const uint v = kl + i * LANES, qo = t * p.q_stride + (h0 + g) * Dh + 4u * v;
            qr[g][i] = g < G && v < DV ? vec4(q[qo], q[qo + 1], q[qo + 2], q[qo + 3]) * p.scale : vec4(0.0);
            acc[g][i] = vec4(0.0);
        }
    }
    for (uint jb = c0 + sg * kps; jb < c1; jb += nsg * kps) {  // uniform per subgroup
        const uint j = jb + ks;
        const bool ok = j < c1;
        const uint o = kv_slot(tab, tab_len, min(j, c1 - 1u), B) * row + kvo;
        vec4 kd[MV], vd[MV];
        [[unroll]] for (uint i = 0; i < MV; ++i) {
            const uint v = kl + i * LANES;
            kd[i] = ok && v < DV ? vec4(k_pool[o + v]) : vec4(0.0);
            vd[i] = ok && v < DV ? vec4(v_pool[o + v]) : vec4(0.0);
        }
        [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
            if (g < G) {
                float dt = 0.0;
                [[unroll]] for (uint i = 0; i < MV; ++i) dt += dot(qr[g][i], kd[i]);
                [[unroll]] for (uint x = LANES / 2u; x > 0u; x /= 2u) dt += subgroupShuffleXor(dt, x);
                const float sc = ok ? dt : NEG_INF;
                const float m_new = max(m[g], sc);
                const float corr = rescale(m[g], m_new), w = rescale(sc, m_new);
                l[g] = l[g] * corr + w;
                [[unroll]] for (uint i = 0; i < MV; ++i) acc[g][i] = acc[g][i] * corr + w * vd[i];
                m[g] = m_new;
            }
        }
    }
    // merge the key clusters of the subgroup: lanes l, l ^ LANES, l ^ 2 LANES, ... hold the same dims
    for (uint off = LANES; off < S; off *= 2u) {
        [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
            const float m_o = subgroupShuffleXor(m[g], off), l_o = subgroupShuffleXor(l[g], off);
            const float mx = max(m[g], m_o), fa = rescale(m[g], mx), fb = rescale(m_o, mx);
            l[g] = l[g] * fa + l_o * fb;
            [[unroll]] for (uint i = 0; i < MV; ++i) {
                const vec4 a_o = subgroupShuffleXor(acc[g][i], off);
                acc[g][i] = acc[g][i] * fa + a_o * fb;
            }
            m[g] = mx;
        }
    }
    // merge the subgroups: common max, then the rescaled sums added in subgroup order
    if (lane == 0u) {
        [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
            s_m[sg * MAX_GROUP + g] = m[g];
            s_l[sg * MAX_GROUP + g] = l[g];
        }
    }
    for (uint e = tid; e < G * DV; e += BLOCK_SIZE) s_acc[e] = vec4(0.0);
    barrier();
    float mx[MAX_GROUP], f[MAX_GROUP];
    [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
        mx[g] = NEG_INF;
        for (uint s = 0; s < nsg; ++s) mx[g] = max(mx[g], s_m[s * MAX_GROUP + g]);
        f[g] = rescale(m[g], mx[g]);  // a subgroup without keys adds nothing
    }
    for (uint s = 0; s < nsg; ++s) {
        if (s == sg && lane < LANES) {
            [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) {
                [[unroll]] for (uint i = 0; i < MV; ++i) {
                    const uint v = kl + i * LANES;
                    if (g < G && v < DV) s_acc[g * DV + v] += f[g] * acc[g][i];
                }
            }
        }
        barrier();
    }
    for (uint e = tid; e < G * DV; e += BLOCK_SIZE) {
        const uint g = e / DV, v = e % DV;
        const uint pb = part_base(t, h0 + g, c) + PART_ACC + 4u * v;
        [[unroll]] for (uint k = 0; k < 4u; ++k) part[pb + k] = s_acc[e][k];
    }
    if (tid < G) {
        float lsum = 0.0;
        for (uint s = 0; s < nsg; ++s) lsum += s_l[s * MAX_GROUP + tid] * rescale(s_m[s * MAX_GROUP + tid], mx[tid]);
        const uint pb = part_base(t, h0 + tid, c);
        part[pb] = mx[tid];
        part[pb + 1] = lsum;
    }
}
