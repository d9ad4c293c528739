#version 450
// y[t, j] = gelu_tanh(gate[t, j]) * up[t, j] over (T, F), grid-stride. gelu_tanh(g) = g * 0.5 (1 + tanh(u)),
// u = sqrt(2/pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2u)): the same value, and no inf/inf for large |g|
// where a driver's tanh may be exp-based. Strides let gate and up be the two halves of a fused gate|up row.
#include "common.glsl"

layout(binding = 0) readonly buffer G { float gate[]; };
layout(binding = 1) readonly buffer U { float up[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n_cols;  // F
    uint n_rows;  // T
    uint gate_stride;
    uint up_stride;
    uint y_stride;
} p;

void main() {
    const uint n = p.n_cols * p.n_rows;
    const uint stride = grid_size();
    for (uint i = global_index(); i < n; i += stride) {
        const uint r = i / p.n_cols, c = i % p.n_cols;
        y[r * p.y_stride + c] = gelu_mul(gate[r * p.gate_stride + c], up[r * p.up_stride + c]);
    }
}
