#version 450
// y[t * y_stride + row_offset + n] = sum_s part[(s * T + t) * N + n] for t < T, n < N: the partial sums of
// a matmul whose K was split over workgroups (mul_mm_coopmat.comp), added in split order. Grid-stride.
// GEGLU: binding 2 holds the up projection's partial sums (same layout) and y = gelu_tanh(gate) * up of the
// two sums (common.glsl's gelu_mul, as geglu.comp): the FFN's two matmuls and its GeGLU in one pass.
#include "common.glsl"

layout(binding = 0) readonly buffer P { float part[]; };
layout(binding = 1) writeonly buffer Y { float y[]; };
#ifdef GEGLU
layout(binding = 2) readonly buffer PU { float part_up[]; };
#endif

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
#ifdef GEGLU
        float up = 0.0;
        for (uint s = 0; s < p.splits; ++s) up += part_up[s * total + i];
        acc = gelu_mul(acc, up);
#endif
        const uint t = i / p.N, n = i % p.N;
        y[t * p.y_stride + p.row_offset + n] = acc;
    }
}
