#version 450
// Reads src once, 16 bytes (uvec4) per load, grid-stride, and writes nothing (in practice): the read-only
// bandwidth ceiling, the one a decode step's weight reads compare with (copy.comp also writes what it reads).
// Each invocation XORs what it loaded and stores its word only if that equals a constant, which keeps the
// loads alive. Variants: UNROLL = independent loads in flight per invocation per iteration; PREFETCH: the
// backend's weight prefetch (VulkanBackend.prefetch: a weight read ahead into the GPU's last-level cache
// while latency-bound kernels run), whose rare store goes to dst[0] (dst is a few bytes of its own).
#include "common.glsl"

#ifndef UNROLL
#define UNROLL 1
#endif

layout(binding = 0) readonly buffer Src { uvec4 src[]; };
layout(binding = 1) writeonly buffer Dst { uint dst[]; };

layout(push_constant) uniform Push {
    uint n;  // uvec4 elements to read
} p;

void main() {
    const uint stride = grid_size();
    uint i = global_index();
    uvec4 acc = uvec4(0u);
    for (; i + (UNROLL - 1) * stride < p.n; i += UNROLL * stride) {
        uvec4 v[UNROLL];
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) v[u] = src[i + u * stride];
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) acc ^= v[u];
    }
    for (; i < p.n; i += stride) acc ^= src[i];
    const uint x = acc.x ^ acc.y ^ acc.z ^ acc.w;
#ifdef PREFETCH
    if (x == 0x9E3779B9u) dst[0] = x;
#else
    if (x == 0x9E3779B9u) dst[global_index()] = x;
#endif
}
