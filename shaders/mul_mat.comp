#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for many tokens (prefill), W in its GGUF type
// (dequant.glsl, TYPE_* define). Tiled: a workgroup owns a BN x BT tile of y (rows n0.., tokens t0..);
// per step of BK along K it decodes the BN x BK tile of W into shared memory (one dq8 per invocation) and
// loads the BT x BK tile of x, then every invocation accumulates a 4 x 4 micro-tile (rows tx + 16j, tokens
// ty + 16i: conflict-free shared reads) in registers. Same push constants as mul_mat_vec.comp.
// Requires BLOCK_SIZE == 256, K % 32 == 0, x_stride % 4 == 0. Dispatch (ceil(N / 64), ceil(T / 64)).
#include "common.glsl"
#include "dequant.glsl"

#define BN 64u
#define BT 64u
#define BK 32u

layout(binding = 1) readonly buffer X { vec4 x4[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;
    uint y_stride;
    uint row_bytes;
    uint row_offset;
} p;

shared float ws[BK][BN + 1u];  // W tile, transposed: ws[k][n]
shared float xs[BK][BT + 1u];  // x tile, transposed: xs[k][t]

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint n0 = gl_WorkGroupID.x * BN, t0 = gl_WorkGroupID.y * BT;
    const uint tx = tid % 16u, ty = tid / 16u;
    const uint xs4 = p.x_stride / 4u;
    // this invocation's share of the W tile: 8 weights (k-group wq) of tile row wr
    const uint wr = tid / 4u, wq = tid % 4u;
    const uint wrow = min(n0 + wr, p.N - 1u) * (p.row_bytes / WSIZE);
    float acc[4][4];
    [[unroll]] for (uint i = 0; i < 4u; ++i) [[unroll]] for (uint j = 0; j < 4u; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0; k0 < p.K; k0 += BK) {
        vec4 lo, hi;
        dq8(wrow, k0 + 8u * wq, lo, hi);
        [[unroll]] for (uint e = 0; e < 4u; ++e) {
            ws[8u * wq + e][wr] = lo[e];
            ws[8u * wq + 4u + e][wr] = hi[e];
        }
        [[unroll]] for (uint h = 0; h < 2u; ++h) {
            const uint idx = tid + 256u * h, t = idx / 8u, q = idx % 8u;
            const vec4 v = t0 + t < p.T ? x4[(t0 + t) * xs4 + k0 / 4u + q] : vec4(0.0);
            [[unroll]] for (uint e = 0; e < 4u; ++e) xs[4u * q + e][t] = v[e];
        }
        barrier();
        [[unroll]] for (uint k = 0; k < BK; ++k) {
            float a[4], b[4];
            [[unroll]] for (uint i = 0; i < 4u; ++i) a[i] = xs[k][ty + 16u * i];
            [[unroll]] for (uint j = 0; j < 4u; ++j) b[j] = ws[k][tx + 16u * j];
            [[unroll]] for (uint i = 0; i < 4u; ++i) [[unroll]] for (uint j = 0; j < 4u; ++j) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const uint t = t0 + ty + 16u * i;
        [[unroll]] for (uint j = 0; j < 4u; ++j) {
            const uint n = n0 + tx + 16u * j;
            if (t < p.T && n < p.N) y[t * p.y_stride + p.row_offset + n] = acc[i][j];
        }
    }
}
