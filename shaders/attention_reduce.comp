#version 450
// Split-K attention, pass 2 of 2: combine the n_splits partials (m, l, acc[Dh]) that attention_split.comp
// wrote per (token, head) into o[t, h] = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c, M = max_c m_c
// over the splits with l_c > 0 (the others are empty and their acc is never read). No live split (a padding
// row): zeros. One workgroup per (token, head): the split weights go through shared memory, then invocations
// over the dims. Host asserts n_splits <= MAX_SPLITS. Q8OUT: o is also written quantized for the int8 mat-vec
// of the output projection (q8act.glsl; a head's Dh values are whole blocks of 32, o_stride % 64 == 0),
// through shared memory.
#include "common.glsl"
#ifdef Q8OUT
#include "q8act.glsl"
#endif
#define MAX_SPLITS 256
#define MAX_HEAD_DIM 256

layout(binding = 0) readonly buffer Part { float part[]; };
layout(binding = 1) writeonly buffer O { float o[]; };
#ifdef Q8OUT
layout(binding = 2) writeonly buffer OQ { uint oq[]; };
layout(binding = 3) writeonly buffer OD { vec2 od[]; };
shared float s_o[MAX_HEAD_DIM];
#endif

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;
    uint head_dim;
    uint n_splits;
    uint o_stride;  // elements between tokens of o
} p;

shared float s_m[MAX_SPLITS];
shared float s_l[MAX_SPLITS];
shared uint s_live[MAX_SPLITS];
shared uint s_n;
shared float s_inv_l;

void main() {
    const uint g = group_index();
    const uint t = g / p.n_heads, h = g % p.n_heads;
    if (t >= p.n_tokens) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint pstride = p.head_dim + 2;
    const uint pb = (t * p.n_heads + h) * p.n_splits * pstride;
    for (uint c = tid; c < p.n_splits; c += BLOCK_SIZE) {
        s_m[c] = part[pb + c * pstride];
        s_l[c] = part[pb + c * pstride + 1];
    }
    barrier();
    if (tid == 0) {
        float M = uintBitsToFloat(0xFF800000u);
        for (uint c = 0; c < p.n_splits; ++c)
            if (s_l[c] > 0.0) M = max(M, s_m[c]);
        float L = 0.0;
        uint n = 0;
        for (uint c = 0; c < p.n_splits; ++c) {
            if (s_l[c] > 0.0) {
                const float w = exp(s_m[c] - M);
                L += s_l[c] * w;
                s_m[n] = w;  // n <= c: compacted weights of the live splits
                s_live[n] = c;
                ++n;
            }
        }
        s_n = n;
        s_inv_l = n > 0 ? 1.0 / L : 0.0;
    }
    barrier();
    const uint n = s_n;
    const float inv_l = s_inv_l;
    const uint ob = t * p.o_stride + h * p.head_dim;
    for (uint d = tid; d < p.head_dim; d += BLOCK_SIZE) {
        float a = 0.0;
        for (uint i = 0; i < n; ++i) a += part[pb + s_live[i] * pstride + 2 + d] * s_m[i];
        o[ob + d] = a * inv_l;
#ifdef Q8OUT
        s_o[d] = a * inv_l;
#endif
    }
#ifdef Q8OUT
    barrier();
    // one word (4 values) per invocation; the block's max and sum read from shared memory
    for (uint w = tid; w < p.head_dim / 4u; w += BLOCK_SIZE) {
        const uint b0 = (w / 8u) * 32u;
        float amax = 0.0;
        for (uint i = 0; i < 32u; ++i) amax = max(amax, abs(s_o[b0 + i]));
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        const vec4 v = vec4(s_o[4u * w], s_o[4u * w + 1u], s_o[4u * w + 2u], s_o[4u * w + 3u]);
        uint qw[PLANES];
        q8_words(v, d, id, qw);
        const uint rw = p.o_stride / 4u;  // plane pl of token t is XQ row PLANES * t + pl
        const uint at = xq_word((h * p.head_dim) / 4u + w, rw / 16u);
        [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) oq[(PLANES * t + pl) * rw + at] = qw[pl];
        if (w % 8u == 0u) {  // the block's XD entry, from its 8 words' shares
            float sum = 0.0;
            for (uint i = 0; i < 32u; i += 4u) {
                uint unused[PLANES];
                sum += q8_words(vec4(s_o[b0 + i], s_o[b0 + i + 1u], s_o[b0 + i + 2u], s_o[b0 + i + 3u]), d, id, unused);
            }
            od[(t * p.o_stride + h * p.head_dim) / 32u + w / 8u] = q8_block_ds(d, sum);
        }
    }
#endif
}
