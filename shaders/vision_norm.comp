#version 450
// Row norms of the vision encoder, one workgroup a row of D values (x and y rows D apart):
//   LayerNorm (default): y = (x - mean) / sqrt(var + eps) * w + b, var the biased variance, two passes
//     (the mean, then the mean of (x - mean)^2) as the numpy reference computes it;
//   RMS (define RMS): y = x / sqrt(mean(x^2) + eps) * w (the projector's norm; w already 1 + weight; the
//     bindings are x, w, y: no bias).
// Requires BLOCK_SIZE a power of two <= 256. Dispatch rows workgroups (group_index()).
#include "common.glsl"

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) readonly buffer Wt { float w[]; };
#ifdef RMS
layout(binding = 2) writeonly buffer Y { float y[]; };
#else
layout(binding = 2) readonly buffer Bs { float b[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };
#endif

layout(push_constant) uniform Push {
    uint D;
    uint rows;
    float eps;
} p;

shared float red[256];

float block_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    red[tid] = v;
    barrier();
    for (uint s = BLOCK_SIZE / 2u; s > 0u; s >>= 1u) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    const float total = red[0];
    barrier();
    return total;
}

void main() {
    const uint row = group_index();
    if (row >= p.rows) return;
    const uint tid = gl_LocalInvocationID.x, base = row * p.D;
#ifdef RMS
    float ss = 0.0;
    for (uint i = tid; i < p.D; i += BLOCK_SIZE) ss += x[base + i] * x[base + i];
    const float r = inversesqrt(block_sum(ss) / float(p.D) + p.eps);
    for (uint i = tid; i < p.D; i += BLOCK_SIZE) y[base + i] = x[base + i] * r * w[i];
#else
    float s = 0.0;
    for (uint i = tid; i < p.D; i += BLOCK_SIZE) s += x[base + i];
    const float mean = block_sum(s) / float(p.D);
    float ss = 0.0;
    for (uint i = tid; i < p.D; i += BLOCK_SIZE) {
        const float d = x[base + i] - mean;
        ss += d * d;
    }
    const float r = inversesqrt(block_sum(ss) / float(p.D) + p.eps);
    for (uint i = tid; i < p.D; i += BLOCK_SIZE) y[base + i] = (x[base + i] - mean) * r * w[i] + b[i];
#endif
}
