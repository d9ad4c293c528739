#version 450
// Split-K attention, pass 2 of 2: combine the n_splits partials (m, l, acc[Dh]) that attention_split.comp (or
// attention_decode*.comp) wrote per (token, head) into o[t, h] = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c,
// M = max_c m_c over the splits with l_c > 0 (the others are empty and their acc is never read). No live split
// (a padding row): zeros. One workgroup per (token, head): the split weights go through shared memory, then
// invocation (g, v) of the BLOCK_SIZE / (Dh / 4) groups adds the weighted dims 4v..4v+3 of live splits g,
// g + groups, ... (a few vec4 reads each, all in flight at once), and the groups' sums add up in group order.
// The partials in attention_part.glsl's layout (acc 16-byte aligned), read as vec4: Dh % 4 == 0,
// Dh / 4 <= BLOCK_SIZE. Host asserts n_splits <= MAX_SPLITS. Q8OUT: o is also written quantized for the int8
// mat-vec of the output projection (q8act.glsl; a head's Dh values are whole blocks of 32, o_stride % 64 == 0),
// through shared memory.
#include "common.glsl"
#define PART_ACC 4u  // attention_part.glsl: (m, l, pad, pad, acc[Dh])
#define MAX_SPLITS 256
#define MERGE_HEAD_DIM 256

layout(binding = 0) readonly buffer Part { vec4 part4[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;
    uint head_dim;
    uint n_splits;
    uint o_stride;  // elements between tokens of o
} p;

#ifdef Q8OUT
#include "q8act.glsl"
#endif

layout(binding = 1) writeonly buffer O { float o[]; };
#ifdef Q8OUT
layout(binding = 2) writeonly buffer OQ { uint oq[]; };
layout(binding = 3) writeonly buffer OD { vec2 od[]; };
shared float r_o[MERGE_HEAD_DIM];
#endif

shared float r_w[MAX_SPLITS];
shared float r_l[MAX_SPLITS];
shared uint r_live[MAX_SPLITS];
shared uint r_n;
shared float r_inv_l;
shared vec4 r_acc[BLOCK_SIZE];  // the invocation groups' sums (merge_head)

// The live splits' weights exp(m_c - M) compacted into r_w[0..r_n), their indices in r_live, 1 / L in r_inv_l;
// h4: the vec4 index of split 0's partial, ps4: vec4s a partial
void merge_weights(uint h4, uint ps4, uint tid) {
    for (uint c = tid; c < p.n_splits; c += BLOCK_SIZE) {
        const vec2 ml = part4[h4 + c * ps4].xy;
        r_w[c] = ml.x;
        r_l[c] = ml.y;
    }
    barrier();
    if (tid == 0) {
        float M = uintBitsToFloat(0xFF800000u);
        for (uint c = 0; c < p.n_splits; ++c)
            if (r_l[c] > 0.0) M = max(M, r_w[c]);
        float L = 0.0;
        uint n = 0;
        for (uint c = 0; c < p.n_splits; ++c) {
            if (r_l[c] > 0.0) {
                const float w = exp(r_w[c] - M);
                L += r_l[c] * w;
                r_w[n] = w;  // n <= c: compacted weights of the live splits
                r_live[n] = c;
                ++n;
            }
        }
        r_n = n;
        r_inv_l = n > 0 ? 1.0 / L : 0.0;
    }
    barrier();
}

#ifdef Q8OUT
// o[t, h]'s q8 planes and block scales from r_o: one word (4 values) per invocation
void merge_q8(uint t, uint h, uint tid) {
    for (uint w = tid; w < p.head_dim / 4u; w += BLOCK_SIZE) {
        const uint b0 = (w / 8u) * 32u;
        float amax = 0.0;
        for (uint i = 0; i < 32u; ++i) amax = max(amax, abs(r_o[b0 + i]));
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        const vec4 v = vec4(r_o[4u * w], r_o[4u * w + 1u], r_o[4u * w + 2u], r_o[4u * w + 3u]);
        uint qw[PLANES];
        q8_words(v, d, id, qw);
        const uint rw = p.o_stride / 4u;  // plane pl of token t is XQ row PLANES * t + pl
        const uint at = xq_word((h * p.head_dim) / 4u + w, rw / 16u);
        [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) oq[(PLANES * t + pl) * rw + at] = qw[pl];
        if (w % 8u == 0u) {  // the block's XD entry, from its 8 words' shares
            float sum = 0.0;
            for (uint i = 0; i < 32u; i += 4u) {
                uint unused[PLANES];
                sum += q8_words(vec4(r_o[b0 + i], r_o[b0 + i + 1u], r_o[b0 + i + 2u], r_o[b0 + i + 3u]), d, id, unused);
            }
            od[(t * p.o_stride + h * p.head_dim) / 32u + w / 8u] = q8_block_ds(d, sum);
        }
    }
}
#endif

// o[t, h] (and its q8 form) from the partials; every invocation of the workgroup calls it
void merge_head(uint t, uint h) {
    const uint tid = gl_LocalInvocationID.x, DV = p.head_dim / 4u, ps4 = DV + PART_ACC / 4u;
    const uint h4 = (t * p.n_heads + h) * p.n_splits * ps4;
    merge_weights(h4, ps4, tid);
    const uint n = r_n, groups = BLOCK_SIZE / DV, g = tid / DV, v = tid % DV;
    vec4 a = vec4(0.0);
    for (uint i = g; i < n && g < groups; i += groups) a += part4[h4 + r_live[i] * ps4 + PART_ACC / 4u + v] * r_w[i];
    r_acc[tid] = a;
    barrier();
    if (tid < DV) {
        vec4 s = r_acc[tid];
        for (uint k = 1u; k < groups; ++k) s += r_acc[k * DV + tid];
        s *= r_inv_l;
        const uint ob = t * p.o_stride + h * p.head_dim + 4u * tid;
        [[unroll]] for (uint e = 0; e < 4u; ++e) {
            o[ob + e] = s[e];
#ifdef Q8OUT
            r_o[4u * tid + e] = s[e];
#endif
        }
    }
#ifdef Q8OUT
    barrier();
    merge_q8(t, h, tid);
#endif
}

void main() {
    const uint g = group_index();
    const uint t = g / p.n_heads, h = g % p.n_heads;
    if (t >= p.n_tokens) return;
    merge_head(t, h);
}
