#version 450
// s[t] = the power of two that brings row t of x (T, K) within float16's range for mul_mm_coopmat.comp
// (row_scale.glsl: 1.0 while max_k |x[t, k]| <= 2^14). Dividing by a power of two is exact, and the kernel
// multiplies its float32 sums back by s, so rows in range compute exactly as unscaled and large rows (Gemma's
// activations can pass 65504) do not overflow. One workgroup per row; NaN or inf in a row give a NaN or inf
// scale (the error stays visible in y).
// Also xh[t] = float16(x[t, k] / s[t]) (rows K halves apart, K % 8 == 0), the x operand of mul_mm_coopmat.comp:
// converted once per step (and shared by the matmuls reading x), not once per GEMM tile; within every 8
// values in the order that kernel's tiles hold k (row_scale.glsl's xh_word_k).
#include "common.glsl"
#include "row_scale.glsl"

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) writeonly buffer S { float s[]; };
layout(binding = 2) writeonly buffer XH { uint xh2[]; };  // two float16 per word

layout(push_constant) uniform Push {
    uint K;
    uint T;
    uint x_stride;
} p;

void main() {
    const uint row = group_index();
    if (row >= p.T) return;
    const uint tid = gl_LocalInvocationID.x;
    float m = 0.0;
    for (uint k = tid; k < p.K; k += BLOCK_SIZE) m = sticky_max(m, abs(x[row * p.x_stride + k]));
    const float sc = row_scale_of(m, tid);
    if (tid == 0) s[row] = sc;
    const float inv = 1.0 / sc;  // exact: a power of two
    for (uint i = tid; i < p.K / 2u; i += BLOCK_SIZE) {  // word i of the row
        const uint a = row * p.x_stride + xh_word_k(i);
        xh2[row * (p.K / 2u) + i] = packHalf2x16(vec2(x[a], x[a + 2u]) * inv);
    }
}
