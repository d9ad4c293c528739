// The QOUT tail of mul_mat_vec_q8.comp (GeGLU): y's q8 block b (rows 32b..32b+31 of every token) quantized
// for the down projection by the last workgroup that wrote part of it: quantize_q8.comp's arithmetic
// (q8act.glsl), 8 invocations a block of a token, one vec4 each (the block's max and sum through shared
// memory, as quantize_q8.comp): the coherent reads of arrive.glsl, one each and all at once.

layout(binding = 5) writeonly buffer YQ { uint yq[]; };
layout(binding = 6) writeonly buffer YD { vec2 yd[]; };
layout(binding = 7) coherent buffer Cnt { uint cnt[]; };
layout(binding = 8) coherent readonly buffer YV { vec4 yv[]; };
#include "arrive.glsl"

shared float qo_max[8u * MAX_T];
shared float qo_sum[8u * MAX_T];

void quantize_block(uint b) {
    const uint tid = gl_LocalInvocationID.x, words = p.N / 4u, t = tid / 8u, j = tid % 8u;
    const bool live = t < p.T;
    const vec4 v = live ? yv[t * (p.y_stride / 4u) + 8u * b + j] : vec4(0.0);
    if (live) qo_max[tid] = max(max(abs(v.x), abs(v.y)), max(abs(v.z), abs(v.w)));
    barrier();
    float amax = 0.0;
    if (live) [[unroll]] for (uint k = 0; k < 8u; ++k) amax = max(amax, qo_max[8u * t + k]);
    const float d = amax / 127.0;
    const float id = d != 0.0 ? 1.0 / d : 0.0;
    uint qw[PLANES];
    const float share = q8_words(v, d, id, qw);
    if (live) {
        const uint at = xq_word(8u * b + j, p.N / 64u);
        [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) yq[(PLANES * t + pl) * words + at] = qw[pl];
        qo_sum[tid] = share;
    }
    barrier();
    if (live && j == 0u) {
        float sum = 0.0;
        [[unroll]] for (uint k = 0; k < 8u; ++k) sum += qo_sum[8u * t + k];
        yd[t * (p.N / 32u) + b] = q8_block_ds(d, sum);
    }
}
