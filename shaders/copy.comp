#version 450
// dst = src, 16 bytes (vec4) per load/store, grid-stride; the bandwidth ceiling every figure is measured against.
// Variants: UNROLL = independent vec4 loads in flight per invocation per iteration.
#include "common.glsl"

#ifndef UNROLL
#define UNROLL 1
#endif

layout(binding = 0) readonly buffer Src { vec4 src[]; };
layout(binding = 1) writeonly buffer Dst { vec4 dst[]; };

layout(push_constant) uniform Push {
    uint n;  // vec4 elements to copy
} p;

void main() {
    const uint stride = grid_size();
    uint i = global_index();
    for (; i + (UNROLL - 1) * stride < p.n; i += UNROLL * stride) {
        vec4 v[UNROLL];
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) v[u] = src[i + u * stride];
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) dst[i + u * stride] = v[u];
    }
    for (; i < p.n; i += stride) dst[i] = src[i];
}
