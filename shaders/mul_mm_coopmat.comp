#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] on cooperative matrices (VK_KHR_cooperative_matrix):
// float16 A (x) and B (W) tiles, float32 accumulators. Same push constants and bindings as mul_mat.comp.
//
// A workgroup owns a BT x BN tile of y (tokens t0.., rows n0..) over one split of K (workgroup z covers
// weights [z * k_split, (z + 1) * k_split)). Per step of BK along K it decodes the BN x BK tile of W
// (dequant.glsl, dq8) and converts the BT x BK tile of x into float16 in shared memory; each of the NSG
// subgroups then multiplies its (BT / 2) x (BN / 4) part as TF x NF 16 x 16 x 16 products (A = x rows,
// row-major; B = Wᵀ, i.e. W rows read column-major). With several splits (gl_NumWorkGroups.z > 1) y is a
// scratch of partial sums, split z at element z * T * y_stride, summed by split_reduce.comp: splitting K
// keeps enough workgroups in flight when few tokens leave few output tiles (decode batches).
// The result goes through a per-subgroup 16 x 16 float32 staging tile so partial tiles, row_offset and any
// y_stride need no alignment. float16 holds |x| up to 65504 at 11 bits of mantissa (the int8 mat-vec keeps
// 8): row t of x is divided by xscale[t], a power of two from row_scale.comp (1 for rows within 2^14), and
// its sums multiplied back, so large activations cannot overflow; accumulation is float32.
// Requires BLOCK_SIZE == 256 with 32-wide subgroups (NSG = 8), K % 32 == 0 and k_split % BK == 0 (the
// last split may be short, by whole 32s), x_stride % 4 == 0. Dispatch (ceil(N / BN), ceil(T / BT), splits).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "dequant.glsl"

#ifndef BT
#define BT 64u
#endif
#ifndef BN
#define BN 128u
#endif
#define BK 64u
#define SK (BK + 8u)     // shared row stride in float16 (pad: 16 bytes, keeps rows 16-byte aligned)
#define SK8 (SK / 8u)    // ... in uvec4 (8 float16): the tiles are stored 8 values per 16-byte store
#define NSG 8u
#define WT (BT / 2u)     // tokens per subgroup
#define WN (BN / 4u)     // rows per subgroup
#define TF (WT / 16u)
#define NF (WN / 16u)

layout(binding = 1) readonly buffer X { vec4 x4[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };
layout(binding = 3) readonly buffer S { float xscale[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;
    uint y_stride;
    uint row_bytes;
    uint row_offset;
    uint k_split;  // weights of K per split (workgroup z)
} p;

shared uvec4 ws[BN * SK8];  // W tile: float16 (n, k) at ws[n * SK8 + k / 8] lane k % 8
shared uvec4 xs[BT * SK8];  // x tile: float16 (t, k) likewise
shared float stage[NSG * 256u];  // one 16 x 16 result tile per subgroup

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

void load_w(uint n0, uint k0, uint k_end, uint tid) {
    [[unroll]] for (uint h = 0; h < BN * BK / 8u / 256u; ++h) {
        const uint idx = tid + 256u * h, r = idx / (BK / 8u), q = idx % (BK / 8u);
        vec4 lo = vec4(0.0), hi = vec4(0.0);
        if (k0 + 8u * q < k_end) dq8(min(n0 + r, p.N - 1u) * (p.row_bytes / WSIZE), k0 + 8u * q, lo, hi);
        ws[r * SK8 + q] = uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), packHalf2x16(hi.zw));
    }
}

void load_x(uint t0, uint k0, uint k_end, uint tid) {
    const uint xs4 = p.x_stride / 4u;
    [[unroll]] for (uint h = 0; h < BT * BK / 8u / 256u; ++h) {
        const uint idx = tid + 256u * h, t = idx / (BK / 8u), q = idx % (BK / 8u);
        vec4 lo = vec4(0.0), hi = vec4(0.0);
        if (t0 + t < p.T && k0 + 8u * q < k_end) {
            const uint a = (t0 + t) * xs4 + k0 / 4u + 2u * q;
            const float inv = 1.0 / xscale[t0 + t];  // exact: a power of two
            lo = x4[a] * inv;
            hi = x4[a + 1u] * inv;
        }
        xs[t * SK8 + q] = uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), packHalf2x16(hi.zw));
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint n0 = gl_WorkGroupID.x * BN, t0 = gl_WorkGroupID.y * BT;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint st = (sg % 2u) * WT, sn = (sg / 2u) * WN;  // this subgroup's corner inside the tile

    CM_C acc[TF][NF];
    [[unroll]] for (uint i = 0; i < TF; ++i) [[unroll]] for (uint j = 0; j < NF; ++j) acc[i][j] = CM_C(0.0);

    const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(p.K, k_begin + p.k_split);
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        load_w(n0, k0, k_end, tid);
        load_x(t0, k0, k_end, tid);
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {
            CM_A a[TF];
            CM_B b[NF];
            [[unroll]] for (uint i = 0; i < TF; ++i)
                coopMatLoad(a[i], xs, (st + 16u * i) * SK8 + kk / 8u, SK8, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < NF; ++j)
                coopMatLoad(b[j], ws, (sn + 16u * j) * SK8 + kk / 8u, SK8, gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint i = 0; i < TF; ++i)
                [[unroll]] for (uint j = 0; j < NF; ++j) acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
        }
        barrier();
    }

    // write out through the staging tile: lane writes 8 of the 256 values
    const uint ybase = gl_WorkGroupID.z * p.T * p.y_stride + p.row_offset;
    [[unroll]] for (uint i = 0; i < TF; ++i) {
        [[unroll]] for (uint j = 0; j < NF; ++j) {
            coopMatStore(acc[i][j], stage, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            [[unroll]] for (uint e = 0; e < 8u; ++e) {
                const uint idx = lane + 32u * e, r = idx / 16u, c = idx % 16u;
                const uint t = t0 + st + 16u * i + r, n = n0 + sn + 16u * j + c;
                if (t < p.T && n < p.N) y[ybase + t * p.y_stride + n] = stage[sg * 256u + idx] * xscale[t];
            }
            subgroupBarrier();
        }
    }
}
