#version 450
// vision_attention.comp on cooperative matrices (VK_KHR_cooperative_matrix), after attention_prefill_cm.comp:
// o = softmax(q kᵀ * scale) v per image and head, dense and non-causal; q, k, v, o (n, P, W) float32,
// W = heads * dh, head h in columns h*dh .. h*dh+dh-1. A workgroup takes QV = 32 query rows of one (image,
// head) (dispatch (ceil(P / QV), heads, n)); the products on the matrix units, float16 operands, float32 sums:
//   S = Q Kᵀ  (QV x KC: the rows' scaled q, float16, times a chunk of KC keys),
//   P = exp(S - m) (float16, m the row's reference max; keys past P are 0),
//   O += P V  (QV x DH, float32 accumulators held in registers through all chunks).
// The head is padded with zeros to DH (a multiple of 32: whole 16-wide blocks, OT whole per subgroup) in Q,
// K and V; the padding's columns of O are not written. The reference max moves lazily as in
// attention_prefill_cm.comp (only when a chunk's max passes it by more than TAU; then O's rows are scaled
// through shared memory), and the output is O / l, l the sum of the float16 P values that P V multiplied.
// With ``bias`` set, q, k and v are read plus their biases qb, kb, vb (W,) (the GEMMs' biases, added here).
// Requires 32-wide subgroups (NSG = 4 of BLOCK_SIZE = 128), dh % 8 == 0, dh <= DH.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#ifndef DH
#define DH 96u
#endif
#define QV 32u               // query rows a workgroup: 2 blocks of 16
#define KC 32u               // keys a chunk: 2 blocks of 16
#define NSG 4u               // subgroups of 32
#define DB (DH / 16u)        // head-dim blocks
#define OT (2u * DB / NSG)   // O tiles a subgroup holds
#define SK8 (DH / 8u + 1u)   // shared row stride of s_k, s_v in uvec4 (8 float16; 16 bytes of pad)
#define SP8 (KC / 8u + 1u)   // ... of s_p
#define TAU 8.0

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer K { float k[]; };
layout(binding = 2) readonly buffer V { float v[]; };
layout(binding = 3) writeonly buffer O { float o_out[]; };
layout(binding = 4) readonly buffer QB { float qb[]; };
layout(binding = 5) readonly buffer KB { float kb_[]; };
layout(binding = 6) readonly buffer VB { float vb[]; };

layout(push_constant) uniform Push {
    uint P;  // patches per image
    uint W;  // row width: heads * dh
    uint dh;
    float scale;
    uint bias;  // 1: add qb, kb, vb
} p;

#define NEG_INF uintBitsToFloat(0xFF800000u)
#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

shared uvec4 s_k[KC * SK8];  // (key, dims): K of the chunk; first Q (query row, dims)
shared uvec4 s_v[KC * SK8];  // (key, dims)
shared float s_s[QV * KC];   // S (query row, key); then 4 subgroup scratch tiles of 16 x 16
shared uvec4 s_p[QV * SP8];  // P (query row, key)
shared float s_corr[QV];     // this chunk's factor of each row of O; at the end each row's l
shared uint s_rescale;       // some row's reference max moved this chunk

// Eight values of a row of x (float32) from element o, plus the bias's from element c when ``bias``
#define LOAD8(x, xb, o, c, lo, hi)                                                                   \
    {                                                                                                \
        lo = vec4(x[o], x[o + 1u], x[o + 2u], x[o + 3u]);                                            \
        hi = vec4(x[o + 4u], x[o + 5u], x[o + 6u], x[o + 7u]);                                       \
        if (p.bias != 0u) {                                                                          \
            lo += vec4(xb[c], xb[c + 1u], xb[c + 2u], xb[c + 3u]);                                   \
            hi += vec4(xb[c + 4u], xb[c + 5u], xb[c + 6u], xb[c + 7u]);                              \
        }                                                                                            \
    }

// Eight floats as the uvec4 of their float16 values, in order
uvec4 pack8_f16(vec4 a, vec4 b) {
    return uvec4(packFloat2x16(f16vec2(a.xy)), packFloat2x16(f16vec2(a.zw)), packFloat2x16(f16vec2(b.xy)),
                 packFloat2x16(f16vec2(b.zw)));
}

// Q of the workgroup's rows (scaled, float16; zeros past P and past dh) into s_k.
void stage_q(uint base_row, uint r0, uint col0, uint tid) {
    for (uint idx = tid; idx < QV * (DH / 8u); idx += BLOCK_SIZE) {
        const uint i = idx / (DH / 8u), w = idx % (DH / 8u), r = r0 + i;
        vec4 x0 = vec4(0.0), x1 = vec4(0.0);
        if (r < p.P && 8u * w < p.dh) {
            const uint o = (base_row + r) * p.W + col0 + 8u * w, c = col0 + 8u * w;
            LOAD8(q, qb, o, c, x0, x1);
            x0 *= p.scale;
            x1 *= p.scale;
        }
        s_k[i * SK8 + w] = pack8_f16(x0, x1);
    }
}

// K and V of keys base .. base + KC - 1 into s_k, s_v (zeros past P and past dh).
void load_chunk(uint base_row, uint base, uint col0, uint tid) {
    for (uint idx = tid; idx < KC * (DH / 8u); idx += BLOCK_SIZE) {
        const uint jj = idx / (DH / 8u), w = idx % (DH / 8u), j = base + jj;
        uvec4 kd = uvec4(0u), vd = uvec4(0u);
        if (j < p.P && 8u * w < p.dh) {
            const uint o = (base_row + j) * p.W + col0 + 8u * w, c = col0 + 8u * w;
            vec4 lo, hi;
            LOAD8(k, kb_, o, c, lo, hi);
            kd = pack8_f16(lo, hi);
            LOAD8(v, vb, o, c, lo, hi);
            vd = pack8_f16(lo, hi);
        }
        s_k[jj * SK8 + w] = kd;
        s_v[jj * SK8 + w] = vd;
    }
}

void main() {
    const uint r0 = gl_WorkGroupID.x * QV, head = gl_WorkGroupID.y, img = gl_WorkGroupID.z;
    const uint base_row = img * p.P, col0 = head * p.dh;
    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint rb = sg % 2u, kb = sg / 2u;  // this subgroup's query block; its key block of S

    // the softmax's row: query row si, keys 8 sq .. 8 sq + 7 of each chunk
    const uint si = tid / 4u, sq = tid % 4u;
    const bool live = r0 + si < p.P;
    float m_ref = NEG_INF, l_run = 0.0;

    stage_q(base_row, r0, col0, tid);
    barrier();
    CM_A qf[DB];
    [[unroll]] for (uint d = 0; d < DB; ++d)
        coopMatLoad(qf[d], s_k, rb * 16u * SK8 + 2u * d, SK8, gl_CooperativeMatrixLayoutRowMajor);
    CM_C o[OT];
    [[unroll]] for (uint t = 0; t < OT; ++t) o[t] = CM_C(0.0);
    barrier();  // Q read out of s_k

    for (uint base = 0; base < p.P; base += KC) {
        load_chunk(base_row, base, col0, tid);
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
            const uint jj = 8u * sq + e;
            sv[e] = live && base + jj < p.P ? s_s[si * KC + jj] : NEG_INF;
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
        [[unroll]] for (uint kk = 0; kk < 2u; ++kk)
            coopMatLoad(pa[kk], s_p, rb * 16u * SP8 + 2u * kk, SP8, gl_CooperativeMatrixLayoutRowMajor);
        [[unroll]] for (uint t = 0; t < OT; ++t) {
            const uint db = kb + 2u * t;
            [[unroll]] for (uint kk = 0; kk < 2u; ++kk) {
                CM_B vb;
                coopMatLoad(vb, s_v, kk * 16u * SK8 + 2u * db, SK8, gl_CooperativeMatrixLayoutRowMajor);
                o[t] = coopMatMulAdd(pa[kk], vb, o[t]);
            }
        }
        barrier();  // s_k, s_v, s_p, s_s, s_corr and s_rescale read before the next chunk writes them
    }

    // each row's l, then O / l through the scratch tiles
    if (sq == 0u) s_corr[si] = l_run;
    barrier();
    [[unroll]] for (uint t = 0; t < OT; ++t) {
        coopMatStore(o[t], s_s, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint e = 0; e < 8u; ++e) {
            const uint idx = lane + 32u * e, i = rb * 16u + idx / 16u, d = 16u * (kb + 2u * t) + idx % 16u;
            if (r0 + i < p.P && d < p.dh) o_out[(base_row + r0 + i) * p.W + col0 + d] = s_s[sg * 256u + idx] / s_corr[i];
        }
        subgroupBarrier();
    }
}
