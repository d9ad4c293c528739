#version 450
// attention_split.comp for CPU implementations (Mesa lavapipe / llvmpipe): the same pass 1 of the split-K
// attention over the paged KV cache, the same key splits (attention_part.glsl: split_keys) and the same
// partials (m, l, acc[Dh]) for attention_reduce.comp, but one invocation per item, with no shared memory and
// no barrier. A CPU driver runs invocations side by side in SIMD and pays tens of products for a buffer load
// and a suspension of the whole workgroup for a barrier, so here each invocation keeps its query heads and
// their outputs in its own arrays, reads each key's K and V row once for all of them, and goes KC keys at a
// time: the KC x G scores, the running max and its correction once per chunk, then the outputs
// (docs/tuning.md, "Large steps without cooperative matrices").
// An item is (token, KV head, slice, split): a KV head's G query heads go in slices of up to MAX_GROUP
// (ceil(G / MAX_GROUP) slices, each reading the split's keys), so the arrays stay small, which keeps
// llvmpipe's compile short (docs/tuning.md).
// Every row takes this kernel on such a device (policy.prefill_kernel gives no tiles there), so skip_off is
// read as in attention_split.comp but the tile rows it names are none.
// q, K and V are storage texel buffers (rgba32f; rgba16f for float16 pools: POOL_F16), read a vec4 at a time
// with imageLoad, which a CPU implementation fetches for all its SIMD lanes at once (a storage-buffer load
// goes lane by lane there: physical.texel_loads).
// One workgroup is BLOCK_SIZE items (ops_attention.attend dispatches ceil(T Hkv slices splits / BLOCK_SIZE)).
// Host asserts: Dh <= MAX_HEAD_DIM, Dh % 4 == 0.
#include "common.glsl"
#define MAX_HEAD_DIM 256u
#ifndef MAX_GROUP
#define MAX_GROUP 8u
#endif
#ifndef KC
#define KC 8u  // keys a chunk
#endif
#define D4 (MAX_HEAD_DIM / 4u)

#ifdef POOL_F16
#define POOL_FMT rgba16f
#else
#define POOL_FMT rgba32f
#endif
layout(binding = 0, rgba32f) uniform readonly imageBuffer q_img;
layout(binding = 1, POOL_FMT) uniform readonly imageBuffer k_img;
layout(binding = 2, POOL_FMT) uniform readonly imageBuffer v_img;
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer Part { float part[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh
    uint q_stride;    // elements between tokens of q (a multiple of 4)
    uint n_splits;
    uint block_size;  // B: positions per KV block
    uint window;      // 0: global; else the sliding window W
    uint pos_off;     // meta sections (word offsets)
    uint seq_off;
    uint info_off;
    float scale;
    uint skip_off;    // 0, or the per-row tile flags (attention_split.comp's); rows flagged 1 are skipped
    uint min_keys;    // unused: a split takes at least KC keys
    uint vis_off;     // 0, or the meta section of per-row last visible keys (paged_kv.glsl: last_key)
} p;

#include "paged_kv.glsl"
#include "attention_part.glsl"

// Values 4 d4 .. 4 d4 + 3 of the K or V row at element ``base`` (a multiple of 4: Dh % 4 == 0).
vec4 kv4(uint base, uint d4, bool is_v) {
    const int e = int(base / 4u + d4);
    return is_v ? imageLoad(v_img, e) : imageLoad(k_img, e);
}

void main() {
    const uint item = group_index() * BLOCK_SIZE + gl_LocalInvocationID.x;
    const uint G_all = p.n_heads / p.n_kv_heads, slices = (G_all + MAX_GROUP - 1u) / MAX_GROUP;
    const uint c = item % p.n_splits, rest = item / p.n_splits;
    const uint slice = rest % slices, rest2 = rest / slices;
    const uint kvh = rest2 % p.n_kv_heads, t = rest2 / p.n_kv_heads;
    if (t >= p.n_tokens || tiled_row(t)) return;
    const uint h0 = kvh * G_all + slice * MAX_GROUP, G = min(MAX_GROUP, G_all - slice * MAX_GROUP);
    const uint n4 = p.head_dim / 4u;
    uint c0, c1, tab, tab_len;
    split_keys(t, c, KC, c0, c1, tab, tab_len);
    if (c0 >= c1) {  // an empty split or a padding row: m = -inf, l = 0 (pass 2 gives it no weight)
        [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) {
            if (g < G) {
                part[part_base(t, h0 + g, c)] = NEG_INF;
                part[part_base(t, h0 + g, c) + 1u] = 0.0;
            }
        }
        return;
    }
    const uint row = p.n_kv_heads * p.head_dim, kvo = kvh * p.head_dim, B = p.block_size;

    // llvmpipe ends a loop after 65,535 passes over all of an invocation's loops (its guard against endless
    // shaders): a chunk of KC keys makes 2 Dh / 4 passes (the scores' pass over the dims, the outputs'), and
    // the host keeps a split under ONE_LANE_MAX_KEYS keys (ops_attention.attention_splits).
    vec4 qv[MAX_GROUP * D4];  // (g, d4): the G query heads
    vec4 acc[MAX_GROUP * D4];
    float m_run[MAX_GROUP], l_run[MAX_GROUP];
    [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) {
        const uint qb = (t * p.q_stride + (h0 + min(g, G - 1u)) * p.head_dim) / 4u;
        for (uint d = 0u; d < D4; ++d) {
            qv[g * D4 + d] = d < n4 ? imageLoad(q_img, int(qb + d)) : vec4(0.0);
            acc[g * D4 + d] = vec4(0.0);
        }
        m_run[g] = NEG_INF;
        l_run[g] = 0.0;
    }
    for (uint base = c0; base < c1; base += KC) {
        uint slot[KC];
        bool live[KC];
        [[unroll]] for (uint j = 0u; j < KC; ++j) {
            live[j] = base + j < c1;
            slot[j] = kv_slot(tab, tab_len, live[j] ? base + j : c0, B) * row + kvo;
        }
        // the KC x G scores, a vec4 of each summed over the dims in order (then its 4 lanes): one pass over
        // the dims loads each q vec4 once for the chunk's KC keys
        vec4 dot4[KC * MAX_GROUP];  // (key, g)
        [[unroll]] for (uint i = 0u; i < KC * MAX_GROUP; ++i) dot4[i] = vec4(0.0);
        for (uint d = 0u; d < n4; ++d) {
            vec4 qd[MAX_GROUP];
            [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) qd[g] = qv[g * D4 + d];
            [[unroll]] for (uint j = 0u; j < KC; ++j) {
                const vec4 kd = kv4(slot[j], d, false);
                [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) dot4[j * MAX_GROUP + g] += qd[g] * kd;
            }
        }
        float s[KC * MAX_GROUP];  // (key, g): scores, then probabilities; keys past c1 weigh 0
        [[unroll]] for (uint i = 0u; i < KC * MAX_GROUP; ++i) {
            const vec4 a = dot4[i];
            s[i] = live[i / MAX_GROUP] ? (a.x + a.y + a.z + a.w) * p.scale : NEG_INF;
        }
        float corr[MAX_GROUP];
        [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) {
            float mt = m_run[g];
            [[unroll]] for (uint j = 0u; j < KC; ++j) mt = max(mt, s[j * MAX_GROUP + g]);
            corr[g] = exp(m_run[g] - mt);  // mt finite: key base is live
            float sum = 0.0;
            [[unroll]] for (uint j = 0u; j < KC; ++j) {
                s[j * MAX_GROUP + g] = exp(s[j * MAX_GROUP + g] - mt);
                sum += s[j * MAX_GROUP + g];
            }
            l_run[g] = l_run[g] * corr[g] + sum;
            m_run[g] = mt;
        }
        // the outputs: each acc vec4 read once, corrected, given the chunk's keys in order, written once
        for (uint d = 0u; d < n4; ++d) {
            vec4 a[MAX_GROUP];
            [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) a[g] = acc[g * D4 + d] * corr[g];
            [[unroll]] for (uint j = 0u; j < KC; ++j) {
                const vec4 vd = kv4(slot[j], d, true);
                [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) a[g] += s[j * MAX_GROUP + g] * vd;
            }
            [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) acc[g * D4 + d] = a[g];
        }
    }
    [[unroll]] for (uint g = 0u; g < MAX_GROUP; ++g) {
        if (g < G) {
            const uint pb = part_base(t, h0 + g, c);
            part[pb] = m_run[g];
            part[pb + 1u] = l_run[g];
            for (uint d = 0u; d < D4; ++d) {
                if (d < n4) {
                    const vec4 a = acc[g * D4 + d];
                    const uint e = pb + PART_ACC + 4u * d;
                    part[e] = a.x;
                    part[e + 1u] = a.y;
                    part[e + 2u] = a.z;
                    part[e + 3u] = a.w;
                }
            }
        }
    }
}
