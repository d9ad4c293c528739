#version 450
// Dense attention on cooperative matrices (VK_KHR_cooperative_matrix), flash style, for the vision encoder:
// o = softmax(q kᵀ) v per image and head, non-causal, from vision_qkv_f16.comp's float16 heads qh (scaled),
// kh, vh (n, heads, PP, DH): P keys of a head, PP = P rounded up to whole ROWS, the head zero-padded to DH
// (a multiple of 16); o (n, P, W) float32, W = heads * dh, head h in columns h*dh .. h*dh+dh-1.
// A workgroup takes ROWS = 16 NSG query rows of one (image, head) (dispatch (PP / ROWS, heads, n)); each of
// its NSG subgroups owns 16 of them and works alone (no workgroup barrier; K and V are read from the
// buffers, the subgroups of a workgroup reading the same chunks), chunk by chunk of KC keys:
//   S = Q Kᵀ       (16 x KC on the matrix units: float16 operands, float32 sums),
//   P = exp(S - m) (float16; keys past P masked; m the row's reference max),
//   O += P V       (16 x DH, float32 accumulators held through all chunks).
// S goes through the subgroup's scratch in shared memory for the softmax: lane l takes row l % 16, keys
// (l / 16) * KC/2 .. + KC/2 - 1 (the row stride SS keeps 8 consecutive lanes' vec4 reads on distinct banks).
// The reference max moves lazily (only when a chunk's max passes it by more than TAU; then O's rows are
// scaled through the scratch), and the output is O / l, l the sum of the float16 P values that P V
// multiplied. Requires 32-wide subgroups (NSG = BLOCK_SIZE / 32).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#ifndef DH
#define DH 80u
#endif
#define NSG 4u               // subgroups of 32 (BLOCK_SIZE 128)
#define ROWS (16u * NSG)     // query rows a workgroup
#define KC 64u               // keys a chunk
#define DB (DH / 16u)        // head-dim blocks
#define KB (KC / 16u)        // key blocks a chunk
#define WR (DH / 8u)         // uvec4s a row of qh, kh, vh
#define SS4 (KC / 4u + 1u)   // scratch row stride in vec4 (a float row of S; 16 bytes of pad)
#define SP8 (KC / 8u + 1u)   // P row stride in uvec4 (8 float16)
#define TAU 8.0

layout(binding = 0) readonly buffer QH { uvec4 qh[]; };
layout(binding = 1) readonly buffer KH { uvec4 kh[]; };
layout(binding = 2) readonly buffer VH { uvec4 vh[]; };
layout(binding = 3) writeonly buffer O { float o_out[]; };

layout(push_constant) uniform Push {
    uint P;  // patches per image
    uint W;  // row width of o: heads * dh
    uint dh;
    float scale;  // unused: q comes scaled
    uint bias;    // unused: the biases are in qh, kh, vh
} p;

#define NEG_INF uintBitsToFloat(0xFF800000u)
#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

shared vec4 s_s[NSG * 16u * SS4];   // per subgroup: S (row, key); O's tiles when they are scaled or written
shared uvec4 s_p[NSG * 16u * SP8];  // per subgroup: P (row, key) in float16

void sync_subgroup() {
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

// Row r's columns 8 half .. 8 half + 7 of O tile ``t`` through the scratch at ``s0``, as (lo, hi)
void tile_row(CM_C t, uint s0, uint r, uint half_, out vec4 lo, out vec4 hi) {
    coopMatStore(t, s_s, s0, SS4, gl_CooperativeMatrixLayoutRowMajor);
    sync_subgroup();
    lo = s_s[s0 + r * SS4 + 2u * half_];
    hi = s_s[s0 + r * SS4 + 2u * half_ + 1u];
}

void main() {
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint head = gl_WorkGroupID.y, img = gl_WorkGroupID.z, heads = gl_NumWorkGroups.y;
    const uint pp = gl_NumWorkGroups.x * ROWS;
    const uint r0 = gl_WorkGroupID.x * ROWS + 16u * sg;  // this subgroup's first query row
    const uint hb = (img * heads + head) * pp;           // the head's row 0 in qh, kh, vh
    const uint s0 = sg * 16u * SS4, p0 = sg * 16u * SP8;
    const uint r = lane % 16u, half_ = lane / 16u;       // this lane's softmax row and half of the keys

    CM_A qf[DB];
    [[unroll]] for (uint d = 0; d < DB; ++d)
        coopMatLoad(qf[d], qh, (hb + r0) * WR + 2u * d, WR, gl_CooperativeMatrixLayoutRowMajor);
    CM_C o[DB];
    [[unroll]] for (uint d = 0; d < DB; ++d) o[d] = CM_C(0.0);
    float m_ref = NEG_INF, l_run = 0.0;

    for (uint base = 0; base < p.P; base += KC) {
        // S = Q Kᵀ over the chunk's KB key blocks (Kᵀ: kh read column-major)
        [[unroll]] for (uint kb = 0; kb < KB; ++kb) {
            CM_C s = CM_C(0.0);
            [[unroll]] for (uint d = 0; d < DB; ++d) {
                CM_B kt;
                coopMatLoad(kt, kh, (hb + base + 16u * kb) * WR + 2u * d, WR, gl_CooperativeMatrixLayoutColumnMajor);
                s = coopMatMulAdd(qf[d], kt, s);
            }
            coopMatStore(s, s_s, s0 + 4u * kb, SS4, gl_CooperativeMatrixLayoutRowMajor);
        }
        sync_subgroup();
        // the softmax of row r over its half of the chunk: mask, the chunk's max, the reference, P
        vec4 sv[KC / 8u];
        float mc = NEG_INF;
        [[unroll]] for (uint c = 0; c < KC / 8u; ++c) {
            const uint key = base + half_ * (KC / 2u) + 4u * c;
            vec4 x = s_s[s0 + r * SS4 + half_ * (KC / 8u) + c];
            x = mix(x, vec4(NEG_INF), greaterThanEqual(uvec4(key) + uvec4(0u, 1u, 2u, 3u), uvec4(p.P)));
            sv[c] = x;
            mc = max(mc, max(max(x.x, x.y), max(x.z, x.w)));
        }
        mc = max(mc, subgroupShuffleXor(mc, 16u));
        float corr = 1.0;
        if (mc > m_ref + TAU) {  // also the row's first keys (m_ref = -inf: O is still 0, nothing to scale)
            if (m_ref != NEG_INF) corr = exp(m_ref - mc);
            m_ref = mc;
        }
        float ps = 0.0;
        [[unroll]] for (uint c = 0; c < KC / 8u; c += 2u) {
            const f16vec4 a = f16vec4(exp(sv[c] - m_ref)), b = f16vec4(exp(sv[c + 1u] - m_ref));
            ps += dot(vec4(a) + vec4(b), vec4(1.0));  // l sums the float16 values that P V multiplies
            s_p[p0 + r * SP8 + half_ * (KC / 16u) + c / 2u] =
                uvec4(packFloat2x16(a.xy), packFloat2x16(a.zw), packFloat2x16(b.xy), packFloat2x16(b.zw));
        }
        ps += subgroupShuffleXor(ps, 16u);
        l_run = l_run * corr + ps;
        if (subgroupAny(corr != 1.0)) {  // scale O's rows: lane (r, half) its row's 8 columns of each tile
            [[unroll]] for (uint d = 0; d < DB; ++d) {
                vec4 lo, hi;
                subgroupBarrier();  // the scratch's last reads done
                tile_row(o[d], s0, r, half_, lo, hi);
                s_s[s0 + r * SS4 + 2u * half_] = lo * corr;
                s_s[s0 + r * SS4 + 2u * half_ + 1u] = hi * corr;
                sync_subgroup();
                coopMatLoad(o[d], s_s, s0, SS4, gl_CooperativeMatrixLayoutRowMajor);
            }
        }
        sync_subgroup();  // P written
        // O += P V over the chunk's key blocks
        [[unroll]] for (uint kk = 0; kk < KB; ++kk) {
            CM_A pa;
            coopMatLoad(pa, s_p, p0 + 2u * kk, SP8, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint d = 0; d < DB; ++d) {
                CM_B vb;
                coopMatLoad(vb, vh, (hb + base + 16u * kk) * WR + 2u * d, WR, gl_CooperativeMatrixLayoutRowMajor);
                o[d] = coopMatMulAdd(pa, vb, o[d]);
            }
        }
        subgroupBarrier();  // the scratch and P read before the next chunk writes them
    }

    // O / l, row r's 8 columns of each tile (lanes r and r + 16 hold the same l)
    const uint row = r0 + r;
    const float inv = 1.0 / l_run;
    [[unroll]] for (uint d = 0; d < DB; ++d) {
        vec4 lo, hi;
        subgroupBarrier();
        tile_row(o[d], s0, r, half_, lo, hi);
        const uint col = 16u * d + 8u * half_;
        const uint at = (img * p.P + row) * p.W + head * p.dh + col;
        if (row < p.P) {
            [[unroll]] for (uint e = 0; e < 4u; ++e) {
                if (col + e < p.dh) o_out[at + e] = lo[e] * inv;
                if (col + 4u + e < p.dh) o_out[at + 4u + e] = hi[e] * inv;
            }
        }
    }
}
