#version 450
// Elementwise ops of the vision encoder over n float32 values, grid-stride:
//   ADD:  y[i] = a[i] + b[i % nb] (residuals: nb = n; the position embedding over every image: nb = P * D);
//   GELU: y[i] = gelu_tanh(a[i]) (bindings a, y), as 0.5 a (1 + tanh u) = a / (1 + exp(-2u)), which stays
//         finite for any a (common.glsl's gelu_mul).
#include "common.glsl"

layout(binding = 0) readonly buffer A { float a[]; };
#ifdef GELU
layout(binding = 1) writeonly buffer Y { float y[]; };
#else
layout(binding = 1) readonly buffer B { float b[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };
#endif

layout(push_constant) uniform Push {
    uint n;
    uint nb;
} p;

void main() {
    const uint stride = grid_size();
    for (uint i = global_index(); i < p.n; i += stride) {
#ifdef GELU
        y[i] = gelu_mul(a[i], 1.0);
#else
        y[i] = a[i] + b[i % p.nb];
#endif
    }
}
