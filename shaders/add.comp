#version 450
// d = a + b elementwise over n values (same shapes; the residual adds), grid-stride.
#include "common.glsl"

layout(binding = 0) readonly buffer A { A_TYPE a[]; };
layout(binding = 1) readonly buffer B { A_TYPE b[]; };
layout(binding = 2) writeonly buffer D { D_TYPE d[]; };

layout(push_constant) uniform Push {
    uint n;
} p;

void main() {
    const uint stride = grid_size();
    for (uint i = global_index(); i < p.n; i += stride) {
        d[i] = D_TYPE(float(a[i]) + float(b[i]));
    }
}
