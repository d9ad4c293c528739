#version 450
// s[t] = the power of two that brings row t of x (T, K) within float16's range for mul_mm_coopmat.comp:
// 1.0 while max_k |x[t, k]| <= LIMIT (2^14, headroom below float16's 65504), else 2^ceil(log2(max / LIMIT)).
// Dividing by a power of two is exact, and the kernel multiplies its float32 sums back by s, so rows in
// range compute exactly as unscaled and large rows (Gemma's activations can pass 65504) do not overflow.
// One workgroup per row; NaN or inf in a row give a NaN or inf scale (the error stays visible in y).
// Also xh[t] = float16(x[t, k] / s[t]) (rows K halves apart, K % 8 == 0), the x operand of mul_mm_coopmat.comp:
// converted once per step (and shared by the matmuls reading x), not once per GEMM tile; within every 8
// values in the order that kernel's tiles hold k: 0,2,1,3,4,6,5,7 (word w of a group = k pair
// (4 (w / 2) + w % 2, that + 2)).
#include "common.glsl"

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) writeonly buffer S { float s[]; };
layout(binding = 2) writeonly buffer XH { uint xh2[]; };  // two float16 per word
shared float s_scale;

layout(push_constant) uniform Push {
    uint K;
    uint T;
    uint x_stride;
} p;

const float LIMIT = 16384.0;
shared float s_max[BLOCK_SIZE];

void main() {
    const uint row = group_index();
    if (row >= p.T) return;
    const uint tid = gl_LocalInvocationID.x;
    float m = 0.0;
    for (uint k = tid; k < p.K; k += BLOCK_SIZE) {
        const float a = abs(x[row * p.x_stride + k]);
        m = isnan(a) || a > m ? a : m;  // NaN sticks
    }
    s_max[tid] = m;
    barrier();
    [[unroll]] for (uint h = BLOCK_SIZE / 2; h > 0; h >>= 1) {
        if (tid < h) {
            const float o = s_max[tid + h];
            if (isnan(o) || o > s_max[tid]) s_max[tid] = o;
        }
        barrier();
    }
    if (tid == 0) {
        const float mx = s_max[0];
        const float sc = mx <= LIMIT ? 1.0 : (isnan(mx) || isinf(mx) ? mx : exp2(ceil(log2(mx / LIMIT))));
        s[row] = sc;
        s_scale = sc;
    }
    barrier();
    const float inv = 1.0 / s_scale;  // exact: a power of two
    for (uint i = tid; i < p.K / 2u; i += BLOCK_SIZE) {  // word i of the row
        const uint w = i % 4u, a = row * p.x_stride + 8u * (i / 4u) + 4u * (w / 2u) + w % 2u;
        xh2[row * (p.K / 2u) + i] = packHalf2x16(vec2(x[a], x[a + 2u]) * inv);
    }
}
