#version 450
// x (T, K) float32 -> XQ / XD (q8act.glsl), one invocation per block of 32 values, grid-stride.
// Requires K % 32 == 0 and x_stride % 4 == 0.
#include "common.glsl"
#include "q8act.glsl"

layout(binding = 0) readonly buffer X { vec4 x4[]; };
layout(binding = 1) writeonly buffer XQ { uint xq[]; };
layout(binding = 2) writeonly buffer XD { vec2 xd[]; };

layout(push_constant) uniform Push {
    uint K;
    uint T;
    uint x_stride;  // floats between rows of x
} p;

void main() {
    const uint per_row = p.K / 32u;
    const uint n = p.T * per_row;
    for (uint b = global_index(); b < n; b += grid_size()) {
        const uint t = b / per_row, j = b % per_row;
        const uint xo = (t * p.x_stride + 32u * j) / 4u;
        vec4 v[8];
        float amax = 0.0;
        [[unroll]] for (uint i = 0; i < 8u; ++i) {
            v[i] = x4[xo + i];
            amax = max(amax, max(max(abs(v[i].x), abs(v[i].y)), max(abs(v[i].z), abs(v[i].w))));
        }
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        int sum = 0;
        const uint qo = t * (p.K / 4u) + 8u * j;
        [[unroll]] for (uint i = 0; i < 8u; ++i) {
            const vec4 r = v[i] * id;
            const ivec4 q = ivec4(sign(r) * floor(abs(r) + 0.5));  // roundf: halves away from zero
            sum += q.x + q.y + q.z + q.w;
            xq[qo + i] = uint(q.x & 0xFF) | (uint(q.y & 0xFF) << 8) | (uint(q.z & 0xFF) << 16) | (uint(q.w) << 24);
        }
        xd[b] = vec2(d, d * float(sum));
    }
}
