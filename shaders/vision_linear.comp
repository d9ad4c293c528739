#version 450
// The vision encoder's GEMM (SigLIP linear layers, the projector, the patch embedding after im2col):
// y[t, n] = sum_k x[t, k] * W(n, k) (+ bias[n] when has_bias), x (T, K) float32 rows K apart, y (T, N).
// W float32 or float16 (W_F16), laid out (N, K) as a PyTorch linear weight, or (K, N) with W_KN (the
// projector's (D, E) matrix). Any K, N, T (every load is bounds-checked; no alignment needed).
// Tiled: a workgroup owns a 64 x 64 tile of y (rows t0.., columns n0..); per BK = 16 step along K it stages
// the tiles of x and W in shared memory, then each invocation accumulates a 4 x 4 micro-tile in registers.
// Requires BLOCK_SIZE == 256. Dispatch (ceil(N / 64), ceil(T / 64)).
#include "common.glsl"

#define BN 64u
#define BT 64u
#define BK 16u

#ifdef W_F16
layout(binding = 0) readonly buffer W { float16_t w[]; };
#else
layout(binding = 0) readonly buffer W { float w[]; };
#endif
layout(binding = 1) readonly buffer X { float x[]; };
layout(binding = 2) readonly buffer B { float bias[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint has_bias;
} p;

shared float ws[BK][BN + 1u];  // W tile: ws[k][n]
shared float xs[BK][BT + 1u];  // x tile: xs[k][t]

float w_at(uint n, uint k) {
#ifdef W_KN
    return float(w[k * p.N + n]);
#else
    return float(w[n * p.K + k]);
#endif
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint n0 = gl_WorkGroupID.x * BN, t0 = gl_WorkGroupID.y * BT;
    const uint tx = tid % 16u, ty = tid / 16u;
    float acc[4][4];
    [[unroll]] for (uint i = 0; i < 4u; ++i) [[unroll]] for (uint j = 0; j < 4u; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0; k0 < p.K; k0 += BK) {
        [[unroll]] for (uint h = 0; h < 4u; ++h) {
            const uint idx = tid + 256u * h;
#ifdef W_KN
            const uint kk = idx / BN, nn = idx % BN;  // consecutive invocations: consecutive n
#else
            const uint nn = idx / BK, kk = idx % BK;  // consecutive invocations: consecutive k
#endif
            const uint n = n0 + nn, k = k0 + kk;
            ws[kk][nn] = n < p.N && k < p.K ? w_at(n, k) : 0.0;
            const uint tt = idx / BK, kx = idx % BK;
            const uint t = t0 + tt, kq = k0 + kx;
            xs[kx][tt] = t < p.T && kq < p.K ? x[t * p.K + kq] : 0.0;
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
    [[unroll]] for (uint j = 0; j < 4u; ++j) {
        const uint n = n0 + tx + 16u * j;
        if (n >= p.N) continue;
        const float b = p.has_bias != 0u ? bias[n] : 0.0;
        [[unroll]] for (uint i = 0; i < 4u; ++i) {
            const uint t = t0 + ty + 16u * i;
            if (t < p.T) y[t * p.N + n] = acc[i][j] + b;
        }
    }
}
