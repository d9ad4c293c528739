#version 450
// Elementwise ops of the vision encoder over n float32 values, grid-stride:
//   ADD:  y[i] = a[i] + b[i % nb] (residuals: nb = n; the position embedding over every image: nb = P * D);
//   ADD3: y[i] = a[i] + b[i % nb] + c[i % nc] (bindings a, b, c, y: a GEMM's output plus its bias, c with
//         nc = N, and a residual or the position embedding b);
//   GELU: y[i] = gelu_tanh(a[i]) (bindings a, y), as 0.5 a (1 + tanh u) = a / (1 + exp(-2u)), which stays
//         finite for any a (common.glsl's gelu_mul); with BIAS (bindings a, b, y) of a[i] + b[i % nb].
#include "common.glsl"

layout(binding = 0) readonly buffer A { float a[]; };
#if defined(GELU) && !defined(BIAS)
layout(binding = 1) writeonly buffer Y { float y[]; };
#elif defined(ADD3)
layout(binding = 1) readonly buffer B { float b[]; };
layout(binding = 2) readonly buffer C { float c[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };
#else
layout(binding = 1) readonly buffer B { float b[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };
#endif

layout(push_constant) uniform Push {
    uint n;
    uint nb;
    uint nc;  // ADD3's
} p;

void main() {
    const uint stride = grid_size();
    for (uint i = global_index(); i < p.n; i += stride) {
#if defined(GELU) && defined(BIAS)
        y[i] = gelu_mul(a[i] + b[i % p.nb], 1.0);
#elif defined(GELU)
        y[i] = gelu_mul(a[i], 1.0);
#elif defined(ADD3)
        y[i] = a[i] + b[i % p.nb] + c[i % p.nc];
#else
        y[i] = a[i] + b[i % p.nb];
#endif
    }
}
