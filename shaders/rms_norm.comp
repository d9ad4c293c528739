#version 450
// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:], one workgroup per row (rows = tokens, or tokens x
// heads for the per-head q/k norms). The sum of squares is accumulated in float32 per invocation, then
// reduced through shared memory (SUBGROUP: subgroupAdd first, shared memory across subgroups).
#include "common.glsl"
#ifdef SUBGROUP
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif

layout(binding = 0) readonly buffer X { A_TYPE x[]; };
layout(binding = 1) readonly buffer W { float w[]; };
layout(binding = 2) writeonly buffer Y { D_TYPE y[]; };

layout(push_constant) uniform Push {
    uint ncols;     // D
    uint nrows;     // rows to normalise
    uint x_stride;  // elements between rows of x
    uint y_stride;  // elements between rows of y
    float eps;
} p;

shared float partial[BLOCK_SIZE];

void main() {
    const uint row = group_index();
    if (row >= p.nrows) return;  // uniform per workgroup: barriers below stay legal
    const uint tid = gl_LocalInvocationID.x;
    const uint xo = row * p.x_stride;
    float sum = 0.0;
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) {
        const float v = float(x[xo + c]);
        sum += v * v;
    }
#ifdef SUBGROUP
    sum = subgroupAdd(sum);
    if (gl_SubgroupInvocationID == 0) partial[gl_SubgroupID] = sum;
    barrier();
    if (tid == 0) {
        float t = 0.0;
        for (uint s = 0; s < gl_NumSubgroups; ++s) t += partial[s];
        partial[0] = t;
    }
    barrier();
#else
    partial[tid] = sum;
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2; s > 0; s >>= 1) {
        if (tid < s) partial[tid] += partial[tid + s];
        barrier();
    }
#endif
    const float scale = inversesqrt(partial[0] / float(p.ncols) + p.eps);
    const uint yo = row * p.y_stride;
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) {
        y[yo + c] = D_TYPE(float(x[xo + c]) * scale * w[c]);
    }
}
