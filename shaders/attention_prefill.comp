#version 450
// Tiled causal attention for prefill rows over the paged KV cache, pass 1 of 2: the rows that the step metadata
// puts in tiles (stepmeta.py: a sequence with at least tile_min_rows rows in the step, cut into tiles of up to
// TILE_ROWS = 32 consecutive rows), written as the same per-(token, head, split) partials (m, l, acc[Dh]) as
// attention_split.comp / attention_decode.comp, which skip those rows; attention_reduce.comp is pass 2 for all.
//   o[t, h] = softmax_j(scale * q[t, h] . k[j]) v[j],  j in [lo_t, hi_t] of t's sequence,
//   lo_t = 0 (global layer, window 0) or max(0, pos_t - window + 1) (sliding window), hi_t = pos_t or the
//   row's visible entry (an image's soft tokens see their whole image: paged_kv.glsl's last_key).
// Why: the per-row kernels load every key once per row; here the QV = 32 query vectors of a workgroup
// (rows x the G = H / Hkv query heads of one KV head) share each chunk of KC keys loaded into shared memory.
//
// Workgroups: (tile, sub-tile, KV head, split). Sub-tile u < G of a tile takes its rows [u * BR, (u + 1) * BR),
// BR = QV / G (host asserts G divides QV), so its QV query vectors are BR rows x G heads.
// Its key range [lo of its first row, the largest hi of its rows] is cut into n_splits runs of
// per = max(ceil(len / n_splits), KC) keys (trailing splits may be empty).
// Invocations: 8 lanes per query vector (lin = subgroup id * subgroup size + lane: the 8 are one aligned
// cluster of a subgroup, host asserts the subgroup size is a multiple of 8); lane l holds the vec4s
// v = l + 8 m (m < DPL / 4) of its q (scaled) and output accumulator; the 4 query vectors of a 32-wide
// subgroup read the same shared-memory addresses. A score is the 8 lanes' partial dots summed by
// subgroupShuffleXor. The online softmax (running max m, sum l) is per query vector, updated once per chunk;
// keys outside [lo_t, hi_t] of the row (causal mask, sliding window, the other sub-tiles' ranges) score
// -inf. (Two query vectors per invocation, each vec4 read from shared memory serving both, measured slower
// (docs/tuning.md): more registers, fewer workgroups.)
// Each (tile row, head, split) gets m = -inf, l = 0 (and zeros for acc) when none of its keys fell in the
// split; attention_reduce ignores such splits.
// Variants: DPL (8, 16, 32: Dh <= 8 DPL) x POOL_TYPE (float, float16_t); KC = 256 / DPL keys a chunk, so a
// chunk of K and one of V are 8 KiB each (float32). Host asserts BLOCK_SIZE = 256, Dh % 4 = 0 and Dh / 4
// dividing 256 (each invocation loads whole vec4s of fixed dims).
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_VEC vec4
#else
#define POOL_VEC f16vec4
#endif
#ifndef DPL
#define DPL 32u
#endif
#define QV 32u
#define LANES 8u
#define MV (DPL / 4u)
#define KC (256u / DPL)
#define CHUNK (KC * LANES * MV)

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_VEC k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_VEC v_pool[]; };
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer Part { float part[]; };

layout(push_constant) uniform Push {
    uint max_tiles;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh
    uint q_stride;    // elements between tokens of q
    uint n_splits;
    uint block_size;  // B: positions per KV block
    uint window;      // 0: global; else the sliding window W
    uint pos_off;     // meta sections (word offsets)
    uint info_off;
    uint tiles_off;
    float scale;
    uint vis_off;     // 0, or the meta section of per-row last visible keys (paged_kv.glsl: last_key)
} p;

#include "paged_kv.glsl"

// 1 + the last key any of rows [r0, r1) sees: a sub-tile's keys end there (its last row's position, or later
// where a row's visible entry says so: an image's soft tokens see their whole image).
uint sub_tile_end(uint r0, uint r1) {
    uint hi = 0u;
    for (uint r = r0; r < r1; ++r) hi = max(hi, last_key(p.vis_off, r, meta[p.pos_off + r]));
    return hi + 1u;
}

#define NEG_INF uintBitsToFloat(0xFF800000u)

shared vec4 s_k[CHUNK];  // (key, vec4 of dims)
shared vec4 s_v[CHUNK];

void main() {
    const uint wg = group_index();
    const uint G = p.n_heads / p.n_kv_heads;
    const uint BR = QV / G;
    const uint c = wg % p.n_splits;
    const uint kvh = (wg / p.n_splits) % p.n_kv_heads;
    const uint u = (wg / (p.n_splits * p.n_kv_heads)) % G;
    const uint tile = wg / (p.n_splits * p.n_kv_heads * G);
    if (tile >= p.max_tiles) return;  // uniform per workgroup (from here on, every early return is)
    const uint seq = meta[p.tiles_off + 3 * tile];
    const uint row0 = meta[p.tiles_off + 3 * tile + 1];
    const uint n_rows = meta[p.tiles_off + 3 * tile + 2];
    const uint r_lo = u * BR, r_hi = min(r_lo + BR, n_rows);
    if (r_lo >= r_hi) return;  // an unused tile entry (0 rows) or a sub-tile past the tile's rows

    const uint Dh = p.head_dim, DV = Dh / 4, pstride = Dh + 4;  // (m, l, pad, pad, acc): attention_part.glsl
    const uint lin = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    const uint qv = lin / LANES, lane = lin % LANES;
    const uint k_lo = window_lo(meta[p.pos_off + row0 + r_lo], p.window);
    const uint k_hi = sub_tile_end(row0 + r_lo, row0 + r_hi);
    const uint per = max((k_hi - k_lo + p.n_splits - 1) / p.n_splits, KC);
    const uint c0 = k_lo + c * per, c1 = min(c0 + per, k_hi);

    const uint r = row0 + r_lo + qv / G, h = kvh * G + qv % G;
    const bool live = r < row0 + r_hi;
    const uint pos = meta[p.pos_off + (live ? r : row0 + r_lo)];
    const uint lo = window_lo(pos, p.window), hi = last_key(p.vis_off, live ? r : row0 + r_lo, pos);
    float m_run = NEG_INF, l_run = 0.0;
    vec4 qr[MV], acc[MV];
    [[unroll]] for (uint m = 0; m < MV; ++m) {
        const uint d = 4 * (lane + m * LANES), qo = r * p.q_stride + h * Dh + d;
        qr[m] = live && d < Dh ? vec4(q[qo], q[qo + 1], q[qo + 2], q[qo + 3]) * p.scale : vec4(0.0);
        acc[m] = vec4(0.0);
    }
    const uint tab = meta[p.info_off + 2 * seq], tab_len = meta[p.info_off + 2 * seq + 1];
    const uint row = p.n_kv_heads * DV, kvo = kvh * DV, B = p.block_size;  // in vec4s
    const uint tid = gl_LocalInvocationID.x, lv = tid % DV, key_step = BLOCK_SIZE / DV;
    for (uint base = c0; base < c1; base += KC) {
        // K and V of keys base .. base + KC - 1 (zeros past c1): invocation tid loads vec4 lv of keys
        // tid / DV + n * key_step (a prefetch of the next chunk into registers measured no faster)
        for (uint jj = tid / DV; jj < KC; jj += key_step) {
            const uint j = base + jj;
            vec4 kd = vec4(0.0), vd = vec4(0.0);
            if (j < c1) {
                const uint o = kv_slot(tab, tab_len, j, B) * row + kvo + lv;
                kd = vec4(k_pool[o]);
                vd = vec4(v_pool[o]);
            }
            s_k[jj * DV + lv] = kd;
            s_v[jj * DV + lv] = vd;
        }
        barrier();
        float s[KC];
        float mc = NEG_INF;
        [[unroll]] for (uint jj = 0; jj < KC; ++jj) {
            float dt = 0.0;
            [[unroll]] for (uint m = 0; m < MV; ++m) {
                const uint v = lane + m * LANES;
                if (v < DV) dt += dot(qr[m], s_k[jj * DV + v]);
            }
            dt += subgroupShuffleXor(dt, 4u);
            dt += subgroupShuffleXor(dt, 2u);
            dt += subgroupShuffleXor(dt, 1u);
            const uint j = base + jj;
            s[jj] = live && j < c1 && j >= lo && j <= hi ? dt : NEG_INF;
            mc = max(mc, s[jj]);
        }
        if (mc != NEG_INF) {  // the row has keys in this chunk
            const float m_new = max(m_run, mc);
            const float corr = exp(m_run - m_new);
            l_run *= corr;
            [[unroll]] for (uint m = 0; m < MV; ++m) acc[m] *= corr;
            [[unroll]] for (uint jj = 0; jj < KC; ++jj) {
                const float w = exp(s[jj] - m_new);
                l_run += w;
                [[unroll]] for (uint m = 0; m < MV; ++m) {
                    const uint v = lane + m * LANES;
                    if (v < DV) acc[m] += w * s_v[jj * DV + v];
                }
            }
            m_run = m_new;
        }
        barrier();  // everyone done with s_k / s_v before the next chunk
    }
    if (!live) return;
    const uint pb = ((r * p.n_heads + h) * p.n_splits + c) * pstride;
    if (lane == 0u) {
        part[pb] = m_run;
        part[pb + 1] = l_run;
    }
    [[unroll]] for (uint m = 0; m < MV; ++m) {
        const uint d = 4 * (lane + m * LANES);
        if (d < Dh) {
            [[unroll]] for (uint e = 0; e < 4; ++e) part[pb + 4 + d + e] = acc[m][e];
        }
    }
}
