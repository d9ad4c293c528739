#version 450
// attention_prefill.comp on cooperative matrices (VK_KHR_cooperative_matrix): the same workgroups (tile,
// sub-tile, KV head, split), the same QV = 32 query vectors (BR = 32 / G rows x the G query heads of a KV
// head) and key ranges, the same partials (m, l, acc[Dh]) for attention_reduce.comp; the products on the
// matrix units, float16 operands and float32 sums:
//   S = Q Kᵀ  (QV x KC: the query vectors' scaled q, float16, times a chunk of KC keys),
//   P = exp(S - m) (float16, m the row's reference max; masked keys 0),
//   O += P V  (QV x Dh, float32 accumulators held in registers through all chunks).
// A cooperative matrix's rows cannot be scaled one by one, so the reference max moves lazily: a row's m is set
// by its first chunk with keys and moves only when a chunk's max passes it by more than TAU (P then stays
// below e^TAU = 2981, well inside float16). When some row moves, the workgroup scales its O rows by
// exp(m_old - m_new) through shared memory (rare after the first chunks: scores grow by > TAU seldom). The
// partial's m is the reference and l, acc are relative to it; pass 2 weighs splits by exp(m_c - M), which
// holds for any reference, so the result is the softmax's.
//
// Per chunk of KC = 32 keys: K, V -> shared (float16; zeros past the split); S tiles (subgroup sg: query block
// rb = sg % 2, key block sg / 2) -> s_s; the softmax (4 invocations a query vector, 8 keys each) -> P in s_p,
// each row's rescale factor in s_corr; the PV products (subgroup sg: block rb, head-dim blocks sg / 2 + 2 i).
// Q (scaled, float16) is staged once through s_k into registers (A fragments of the subgroup's block rb).
// Requires 32-wide subgroups (NSG = 4 of BLOCK_SIZE = 128) and Dh = DH (variants 64, 128, 256); the host's
// side: the kernels in pipelines.py, the pick in backend._prefill_kernel (the scalar kernel elsewhere).
// Bindings and push constants: attention_prefill.comp's.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_VEC vec4
#else
#define POOL_VEC f16vec4
#endif
#ifndef DH
#define DH 128u
#endif
#define QV 32u               // query vectors a workgroup: 2 blocks of 16
#define KC 32u               // keys a chunk: 2 blocks of 16
#define NSG 4u               // subgroups of 32
#define DB (DH / 16u)        // head-dim blocks
#define OT (2u * DB / NSG)   // O tiles a subgroup holds
#define DV (DH / 4u)         // vec4s of a head (in the pools)
#define SK8 (DH / 8u + 1u)   // shared row stride of s_k, s_v in uvec4 (8 float16; 16 bytes of pad)
#define SP8 (KC / 8u + 1u)   // ... of s_p
#define TAU 8.0

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_VEC k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_VEC v_pool[]; };
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer Part { float part[]; };

layout(push_constant) uniform Push {
    uint max_tiles;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh == DH
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
#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

// float16 tiles as uvec4s of 8 (as mul_mm_coopmat.comp's: the fragments' loads index uvec4s)
shared uvec4 s_k[KC * SK8];  // (key, dims): K of the chunk; first Q (query vector, dims)
shared uvec4 s_v[KC * SK8];  // (key, dims)
shared float s_s[QV * KC];   // S (query vector, key); then 4 subgroup scratch tiles of 16 x 16
shared uvec4 s_p[QV * SP8];  // P (query vector, key)
shared float s_corr[QV];       // this chunk's factor of each row of O
shared uint s_rescale;         // some row's reference max moved this chunk

// Query vector i of the sub-tile: its row (token) and head.
uint qv_row(uint row0, uint r_lo, uint i, uint G) { return row0 + r_lo + i / G; }
uint qv_head(uint kvh, uint i, uint G) { return kvh * G + i % G; }

// Eight floats as the uvec4 of their float16 values, in order (common.glsl's pack8_tiles is the GEMM tiles' order)
uvec4 pack8_f16(vec4 a, vec4 b) {
    return uvec4(packFloat2x16(f16vec2(a.xy)), packFloat2x16(f16vec2(a.zw)), packFloat2x16(f16vec2(b.xy)),
                 packFloat2x16(f16vec2(b.zw)));
}

// Q of the sub-tile's query vectors (scaled, float16; zeros for rows past the tile) into s_k.
void stage_q(uint row0, uint r_lo, uint r_hi, uint kvh, uint G, uint tid) {
    for (uint idx = tid; idx < QV * (DH / 8u); idx += BLOCK_SIZE) {
        const uint i = idx / (DH / 8u), w = idx % (DH / 8u), r = qv_row(row0, r_lo, i, G);
        vec4 x0 = vec4(0.0), x1 = vec4(0.0);
        if (r < row0 + r_hi) {
            const uint o = r * p.q_stride + qv_head(kvh, i, G) * DH + 8u * w;
            x0 = vec4(q[o], q[o + 1u], q[o + 2u], q[o + 3u]) * p.scale;
            x1 = vec4(q[o + 4u], q[o + 5u], q[o + 6u], q[o + 7u]) * p.scale;
        }
        s_k[i * SK8 + w] = pack8_f16(x0, x1);
    }
}

// K and V of keys base .. base + KC - 1 of the split [.., c1) into s_k, s_v (zeros past c1).
void load_chunk(uint base, uint c1, uint tab, uint tab_len, uint kvh, uint tid) {
    const uint row = p.n_kv_heads * DV, kvo = kvh * DV;
    for (uint idx = tid; idx < KC * (DH / 8u); idx += BLOCK_SIZE) {
        const uint jj = idx / (DH / 8u), w = idx % (DH / 8u), j = base + jj;
        uvec4 kd = uvec4(0u), vd = uvec4(0u);
        if (j < c1) {
            const uint o = kv_slot(tab, tab_len, j, p.block_size) * row + kvo + 2u * w;
            kd = pack8_f16(vec4(k_pool[o]), vec4(k_pool[o + 1u]));
            vd = pack8_f16(vec4(v_pool[o]), vec4(v_pool[o + 1u]));
        }
        s_k[jj * SK8 + w] = kd;
        s_v[jj * SK8 + w] = vd;
    }
}

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

    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint rb = sg % 2u, kb = sg / 2u;  // this subgroup's query block; its key block of S
    const uint k_lo = window_lo(meta[p.pos_off + row0 + r_lo], p.window);
    const uint k_hi = sub_tile_end(row0 + r_lo, row0 + r_hi);
    const uint per = max((k_hi - k_lo + p.n_splits - 1) / p.n_splits, KC);
    const uint c0 = k_lo + c * per, c1 = min(c0 + per, k_hi);
    const uint tab = meta[p.info_off + 2 * seq], tab_len = meta[p.info_off + 2 * seq + 1];

    // the softmax's row: query vector si, keys 8 sq .. 8 sq + 7 of each chunk
    const uint si = tid / 4u, sq = tid % 4u, s_r = qv_row(row0, r_lo, si, G);
    const bool live = s_r < row0 + r_hi;
    const uint pos = meta[p.pos_off + (live ? s_r : row0 + r_lo)];
    const uint lo = window_lo(pos, p.window), hi = last_key(p.vis_off, live ? s_r : row0 + r_lo, pos);
    float m_ref = NEG_INF, l_run = 0.0;

    stage_q(row0, r_lo, r_hi, kvh, G, tid);
    barrier();
    CM_A qf[DB];
    [[unroll]] for (uint d = 0; d < DB; ++d)
        coopMatLoad(qf[d], s_k, rb * 16u * SK8 + 2u * d, SK8, gl_CooperativeMatrixLayoutRowMajor);
    CM_C o[OT];
    [[unroll]] for (uint t = 0; t < OT; ++t) o[t] = CM_C(0.0);
    barrier();  // Q read out of s_k

    for (uint base = c0; base < c1; base += KC) {
        load_chunk(base, c1, tab, tab_len, kvh, tid);
        barrier();
        if (tid == 0u) s_rescale = 0u;  // the last chunk's readers passed its last barrier; set after the next
        // S block (rb, kb) = Q_rb Kᵀ_kb: Kᵀ is s_k read column-major
        CM_C s = CM_C(0.0);
        [[unroll]] for (uint d = 0; d < DB; ++d) {
            CM_B kt;
            coopMatLoad(kt, s_k, kb * 16u * SK8 + 2u * d, SK8, gl_CooperativeMatrixLayoutColumnMajor);
            s = coopMatMulAdd(qf[d], kt, s);
        }
        coopMatStore(s, s_s, rb * 16u * KC + kb * 16u, KC, gl_CooperativeMatrixLayoutRowMajor);
        barrier();
        // softmax of row si over its 8 keys: mask, the chunk's max, the reference, P
        float sv[8];
        float mc = NEG_INF;
        [[unroll]] for (uint e = 0; e < 8u; ++e) {
            const uint jj = 8u * sq + e, j = base + jj;
            const bool in_range = live && j < c1 && j >= lo && j <= hi;
            sv[e] = in_range ? s_s[si * KC + jj] : NEG_INF;
            mc = max(mc, sv[e]);
        }
        mc = max(mc, subgroupShuffleXor(mc, 1u));
        mc = max(mc, subgroupShuffleXor(mc, 2u));
        float corr = 1.0;
        if (mc > m_ref + TAU) {  // also the row's first keys (m_ref = -inf: O is still 0, nothing to scale)
            if (m_ref != NEG_INF) corr = exp(m_ref - mc);
            m_ref = mc;
        }
        float ps = 0.0;
        uint pw[4];
        [[unroll]] for (uint e = 0; e < 8u; e += 2u) {
            const f16vec2 ph = f16vec2(m_ref == NEG_INF ? vec2(0.0) : exp(vec2(sv[e], sv[e + 1u]) - m_ref));
            pw[e / 2u] = packFloat2x16(ph);
            ps += float(ph.x) + float(ph.y);  // l sums the float16 values that P V multiplies
        }
        ps += subgroupShuffleXor(ps, 1u);
        ps += subgroupShuffleXor(ps, 2u);
        l_run = l_run * corr + ps;
        s_p[si * SP8 + sq] = uvec4(pw[0], pw[1], pw[2], pw[3]);
        if (sq == 0u) {
            s_corr[si] = corr;
            if (corr != 1.0) atomicOr(s_rescale, 1u);
        }
        barrier();
        if (s_rescale != 0u) {  // uniform: scale O's rows through this subgroup's scratch tile in s_s
            [[unroll]] for (uint t = 0; t < OT; ++t) {
                coopMatStore(o[t], s_s, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                [[unroll]] for (uint e = 0; e < 8u; ++e) {
                    const uint idx = lane + 32u * e;
                    s_s[sg * 256u + idx] *= s_corr[rb * 16u + idx / 16u];
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                coopMatLoad(o[t], s_s, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
                subgroupBarrier();
            }
        }
        // O_rb += P_rb V over the chunk's two key blocks
        CM_A pa[2];
        [[unroll]] for (uint k = 0; k < 2u; ++k)
            coopMatLoad(pa[k], s_p, rb * 16u * SP8 + 2u * k, SP8, gl_CooperativeMatrixLayoutRowMajor);
        [[unroll]] for (uint t = 0; t < OT; ++t) {
            const uint db = kb + 2u * t;
            [[unroll]] for (uint k = 0; k < 2u; ++k) {
                CM_B vb;
                coopMatLoad(vb, s_v, k * 16u * SK8 + 2u * db, SK8, gl_CooperativeMatrixLayoutRowMajor);
                o[t] = coopMatMulAdd(pa[k], vb, o[t]);
            }
        }
        barrier();  // s_k, s_v, s_p, s_s and s_rescale read before the next chunk writes them
    }

    // the partials: m, l by the softmax's row owners; acc through the scratch tiles
    const uint pstride = DH + 4u;
    if (live && sq == 0u) {
        const uint pb = ((s_r * p.n_heads + qv_head(kvh, si, G)) * p.n_splits + c) * pstride;
        part[pb] = m_ref;
        part[pb + 1u] = l_run;
    }
    [[unroll]] for (uint t = 0; t < OT; ++t) {
        coopMatStore(o[t], s_s, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint e = 0; e < 8u; ++e) {
            const uint idx = lane + 32u * e, i = rb * 16u + idx / 16u, r = qv_row(row0, r_lo, i, G);
            if (r < row0 + r_hi) {
                const uint pb = ((r * p.n_heads + qv_head(kvh, i, G)) * p.n_splits + c) * pstride;
                part[pb + 4u + 16u * (kb + 2u * t) + idx % 16u] = s_s[sg * 256u + idx];
            }
        }
        subgroupBarrier();
    }
}
