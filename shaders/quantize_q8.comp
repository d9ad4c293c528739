#version 450
// x (T, K) float32 -> XQ / XD (q8act.glsl), one plane, or three with PLANES 3 (the exact decode path). Each
// invocation takes 4 values (one XQ word per plane), 8 invocations a block of 32: the block's max and sum go
// through shared memory. Grid-stride over the T * K / 4 words.
// Requires K % 64 == 0 (XQ's order), x_stride % 4 == 0, BLOCK_SIZE % 8 == 0.
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

shared float s_max[BLOCK_SIZE];
shared float s_sum[BLOCK_SIZE];  // per word: its share of the block's XD s (q8_words)

void main() {
    const uint words = p.K / 4u, n = p.T * words, tid = gl_LocalInvocationID.x, first = tid & ~7u;
    // every invocation runs the same number of rounds (the barriers stay uniform); past n it idles
    for (uint base = group_index() * BLOCK_SIZE; base < n; base += grid_size()) {
        const uint w = base + tid;
        const bool live = w < n;
        const uint t = live ? w / words : 0u, i = live ? w % words : 0u;
        const vec4 v = live ? x4[(t * p.x_stride) / 4u + i] : vec4(0.0);
        s_max[tid] = max(max(abs(v.x), abs(v.y)), max(abs(v.z), abs(v.w)));
        barrier();
        float amax = 0.0;
        [[unroll]] for (uint j = 0; j < 8u; ++j) amax = max(amax, s_max[first + j]);
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        uint qw[PLANES];
        s_sum[tid] = q8_words(v, d, id, qw);
        if (live) {  // plane pl of token t is XQ row PLANES * t + pl
            [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) xq[(PLANES * t + pl) * words + xq_word(i, p.K / 64u)] = qw[pl];
        }
        barrier();
        if (live && tid == first) {
            float sum = 0.0;
            [[unroll]] for (uint j = 0; j < 8u; ++j) sum += s_sum[first + j];
            xd[w / 8u] = q8_block_ds(d, sum);
        }
        barrier();
    }
}
