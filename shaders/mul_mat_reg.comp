#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for many tokens, W in its GGUF type (dequant.glsl, TYPE_*
// define), without shared memory or barriers: an invocation owns RN rows x RT tokens of y in registers and
// reads W and x straight from their buffers, RN dq8 and 2 RT vec4 loads per 8 K for 8 RN RT products.
// For implementations whose memory accesses cost far more than their arithmetic and whose barriers are
// expensive (CPU drivers: shared memory is the same cache as the buffers); GPUs keep mul_mat.comp
// (kernels_matmul.matmul_kernel says which; docs/tuning.md has the measurements).
// Same push constants and bindings as mul_mat.comp. Invocation i: rows RN * (i % ceil(N / RN)), tokens
// RT * (i / ceil(N / RN)). Requires K % 8 == 0, x_stride % 4 == 0.
// Dispatch ceil(ceil(N / RN) * ceil(T / RT) / BLOCK_SIZE) workgroups.
// TEXEL_LOADS (the _texel variants, where physical.texel_loads): W and x are storage texel buffers, read
// with imageLoad (dequant.glsl), which CPU implementations fetch for all their SIMD lanes at once.
#include "common.glsl"
#include "dequant.glsl"

#ifndef RN
#define RN 16u
#endif
#ifndef RT
#define RT 16u
#endif

#ifdef TEXEL_LOADS
layout(binding = 1, rgba32f) uniform readonly imageBuffer x_img;
#define X4(i) imageLoad(x_img, int(i))
#else
layout(binding = 1) readonly buffer X { vec4 x4[]; };
#define X4(i) x4[i]
#endif
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

void main() {
    const uint nn = (p.N + RN - 1u) / RN;
    const uint i = global_index();
    const uint nb = i % nn, tb = i / nn;
    if (RT * tb >= p.T) return;
    const uint xs4 = p.x_stride / 4u;
    uint rb[RN];  // W's rows (clamped: the rows past N are computed and not written)
    uint xr[RT];  // x's rows (likewise)
    [[unroll]] for (uint j = 0; j < RN; ++j) rb[j] = min(RN * nb + j, p.N - 1u) * (p.row_bytes / WSIZE);
    [[unroll]] for (uint r = 0; r < RT; ++r) xr[r] = min(RT * tb + r, p.T - 1u) * xs4;
    float acc[RT][RN];
    [[unroll]] for (uint r = 0; r < RT; ++r) [[unroll]] for (uint j = 0; j < RN; ++j) acc[r][j] = 0.0;
    for (uint k = 0; k < p.K; k += 8u) {
        vec4 lo[RN], hi[RN];
        [[unroll]] for (uint j = 0; j < RN; ++j) dq8(rb[j], k, lo[j], hi[j]);
        [[unroll]] for (uint r = 0; r < RT; ++r) {
            const vec4 a = X4(xr[r] + k / 4u), b = X4(xr[r] + k / 4u + 1u);
            [[unroll]] for (uint j = 0; j < RN; ++j) acc[r][j] += dot(a, lo[j]) + dot(b, hi[j]);
        }
    }
    [[unroll]] for (uint r = 0; r < RT; ++r) {
        const uint t = RT * tb + r;
        [[unroll]] for (uint j = 0; j < RN; ++j) {
            const uint n = RN * nb + j;
            if (t < p.T && n < p.N) y[t * p.y_stride + p.row_offset + n] = acc[r][j];
        }
    }
}
