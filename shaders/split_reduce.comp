#version 450
// y[t * y_stride + row_offset + n] = sum_s part[(s * T + t) * N + n] for t < T, n < N: the partial sums of
// a matmul whose K was split over workgroups (mul_mm_coopmat.comp), added in split order. Grid-stride.
#include "common.glsl"

layout(binding = 0) readonly buffer P { float part[]; };
layout(binding = 1) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint N;
    uint T;
    uint splits;
    uint y_stride;
    uint row_offset;
} p;

void main() {
    const uint total = p.T * p.N;
    for (uint i = global_index(); i < total; i += grid_size()) {
        float acc = 0.0;
        for (uint s = 0; s < p.splits; ++s) acc += part[s * total + i];
        const uint t = i / p.N, n = i % p.N;
        y[t * p.y_stride + p.row_offset + n] = acc;
    }
}
