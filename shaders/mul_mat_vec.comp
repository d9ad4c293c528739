#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for t < T <= 8 (decode and small batches), W in its GGUF
// type (dequant.glsl, TYPE_* define). One workgroup computes NUM_ROWS consecutive rows for all T tokens:
// each invocation decodes 8 weights of each row at a time (each weight read once) and uses them for every
// token, then the per-invocation sums are reduced through shared memory (SUBGROUP: subgroupAdd first, then
// one shared slot per subgroup). A weight bound in several ranges (maxStorageBufferRange) is one dispatch per
// range: W indexes from the range's first row, row_offset says which y column that row is.
// Requires K % 8 == 0, x_stride % 4 == 0 (x is read as vec4), BLOCK_SIZE a power of two.
#include "common.glsl"
#ifdef SUBGROUP
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#include "dequant.glsl"

#ifndef NUM_ROWS
#define NUM_ROWS 2
#endif
#define MAX_T 8
#define NACC (NUM_ROWS * MAX_T)

layout(binding = 1) readonly buffer X { vec4 x4[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;           // weights per row (columns of x)
    uint N;           // rows of W in this bound range
    uint T;           // tokens (rows of x and y), 1..8
    uint x_stride;    // floats between rows of x
    uint y_stride;    // floats between rows of y
    uint row_bytes;   // bytes of one W row as stored
    uint row_offset;  // y column of this range's first row
} p;

shared float red[NACC][BLOCK_SIZE];

void main() {
    const uint row0 = group_index() * NUM_ROWS;
    if (row0 >= p.N) return;  // uniform per workgroup: the barriers below stay legal
    const uint tid = gl_LocalInvocationID.x;
    const uint rstride = p.row_bytes / WSIZE;
    const uint xs4 = p.x_stride / 4u;
    uint rb[NUM_ROWS];
    [[unroll]] for (uint r = 0; r < NUM_ROWS; ++r) rb[r] = min(row0 + r, p.N - 1u) * rstride;
    float acc[NACC];
    [[unroll]] for (uint a = 0; a < NACC; ++a) acc[a] = 0.0;

    for (uint g = tid; g < p.K / 8u; g += BLOCK_SIZE) {
        vec4 lo[NUM_ROWS], hi[NUM_ROWS];
        [[unroll]] for (uint r = 0; r < NUM_ROWS; ++r) dq8(rb[r], 8u * g, lo[r], hi[r]);
        [[unroll]] for (uint t = 0; t < MAX_T; ++t) {
            if (t < p.T) {
                const vec4 xa = x4[t * xs4 + 2u * g], xb = x4[t * xs4 + 2u * g + 1u];
                [[unroll]] for (uint r = 0; r < NUM_ROWS; ++r) {
                    acc[r * MAX_T + t] += dot(lo[r], xa) + dot(hi[r], xb);
                }
            }
        }
    }

#ifdef SUBGROUP
    [[unroll]] for (uint a = 0; a < NACC; ++a) {
        const float s = subgroupAdd(acc[a]);
        if (gl_SubgroupInvocationID == 0) red[a][gl_SubgroupID] = s;
    }
    barrier();
    if (tid < NACC) {
        float s = 0.0;
        for (uint i = 0; i < gl_NumSubgroups; ++i) s += red[tid][i];
        red[tid][0] = s;
    }
    barrier();
#else
    [[unroll]] for (uint a = 0; a < NACC; ++a) red[a][tid] = acc[a];
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            [[unroll]] for (uint a = 0; a < NACC; ++a) red[a][tid] += red[a][tid + s];
        }
        barrier();
    }
#endif
    if (tid < NACC) {
        const uint r = tid / MAX_T, t = tid % MAX_T;
        if (t < p.T && row0 + r < p.N) y[t * p.y_stride + p.row_offset + row0 + r] = red[tid][0];
    }
}
