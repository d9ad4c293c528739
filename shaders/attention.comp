#version 450
// Causal attention of q (T, H, Dh) over the paged KV cache of one layer, GQA (H / Hkv query heads per KV head):
//   o[t, h] = softmax_j(scale * q[t, h] . k[j]) v[j]  over the key positions j in [lo, pos] of token t's
//   sequence, lo = 0 (global layer, window = 0) or max(0, pos - window + 1) (sliding-window layer).
// The batch comes from the step metadata (hmad/backends/vulkan/stepmeta.py): token t has position
// meta[pos_off + t] and sequence s = meta[seq_off + t] (0xFFFFFFFF: padding row, output zeros); sequence s has
// its block table at meta[info_off + 2s] (absolute index into meta) with meta[info_off + 2s + 1] entries, and
// position j lives in slot table[(j / B) % entries] * B + j % B (a global table covers every position; a local
// one is a ring). The k/v of this step's tokens are already in the pools (kv_write runs first).
//
// One workgroup per (token, head), flash-decoding style: the key positions are taken BLOCK_SIZE at a time,
// one key per invocation for the score, then the chunk's max and sum update a running max m and sum l, and
// each invocation rescales and accumulates its own output dims (d = tid + i * BLOCK_SIZE). Pool elements are
// POOL_TYPE (float, or float16_t); math in float32.
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_TYPE float
#endif
#define MAX_HEAD_DIM 512
#define MAX_DIMS_PER_INVOCATION 4  // head_dim <= 4 * BLOCK_SIZE (asserted on the host)

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_TYPE k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_TYPE v_pool[]; };
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer O { float o[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh
    uint q_stride;    // elements between tokens of q
    uint o_stride;    // elements between tokens of o
    uint block_size;  // B: positions per KV block
    uint window;      // 0: global; else the sliding window W
    uint pos_off;     // meta sections (word offsets)
    uint seq_off;
    uint info_off;
    float scale;
} p;

const uint NONE = 0xFFFFFFFFu;

shared float s_q[MAX_HEAD_DIM];
shared float s_red[BLOCK_SIZE];
shared float s_p[BLOCK_SIZE];
shared uint s_slot[BLOCK_SIZE];

float reduce_max(float v, uint tid) {
    s_red[tid] = v;
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] = max(s_red[tid], s_red[tid + s]);
        barrier();
    }
    const float r = s_red[0];
    barrier();
    return r;
}

float reduce_sum(float v, uint tid) {
    s_red[tid] = v;
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        barrier();
    }
    const float r = s_red[0];
    barrier();
    return r;
}

void main() {
    const uint g = group_index();
    const uint t = g / p.n_heads, h = g % p.n_heads;
    if (t >= p.n_tokens) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x;
    const uint ob = t * p.o_stride + h * p.head_dim;
    const uint seq = meta[p.seq_off + t];
    if (seq == NONE) {
        for (uint d = tid; d < p.head_dim; d += BLOCK_SIZE) o[ob + d] = 0.0;
        return;
    }
    const uint pos = meta[p.pos_off + t];
    const uint tab = meta[p.info_off + 2 * seq], tab_len = meta[p.info_off + 2 * seq + 1];
    const uint lo = (p.window != 0 && pos + 1 > p.window) ? pos + 1 - p.window : 0;
    const uint row = p.n_kv_heads * p.head_dim;
    const uint kvo = (h / (p.n_heads / p.n_kv_heads)) * p.head_dim;
    const uint B = p.block_size;

    const uint qo = t * p.q_stride + h * p.head_dim;
    for (uint d = tid; d < p.head_dim; d += BLOCK_SIZE) s_q[d] = q[qo + d];
    barrier();

    float m = uintBitsToFloat(0xFF800000u);  // running max (-inf)
    float l = 0.0;                           // running sum of exp(score - m)
    float acc[MAX_DIMS_PER_INVOCATION];
    [[unroll]] for (uint i = 0; i < MAX_DIMS_PER_INVOCATION; ++i) acc[i] = 0.0;

    for (uint base = lo; base <= pos; base += BLOCK_SIZE) {
        const uint j = base + tid;
        const bool live = j <= pos;
        float s = uintBitsToFloat(0xFF800000u);
        uint slot = 0;
        if (live) {
            slot = meta[tab + (j / B) % tab_len] * B + j % B;
            const uint ko = slot * row + kvo;
            float dot_qk = 0.0;
            for (uint d = 0; d < p.head_dim; ++d) dot_qk += s_q[d] * float(k_pool[ko + d]);
            s = dot_qk * p.scale;
        }
        const float m_new = max(m, reduce_max(s, tid));  // finite: the chunk has at least one live key
        const float corr = exp(m - m_new);
        const float pj = live ? exp(s - m_new) : 0.0;
        s_p[tid] = pj;
        s_slot[tid] = slot;
        l = l * corr + reduce_sum(pj, tid);  // its barriers also publish s_p and s_slot
        m = m_new;
        const uint nk = min(BLOCK_SIZE, pos + 1 - base);
        [[unroll]] for (uint i = 0; i < MAX_DIMS_PER_INVOCATION; ++i) {
            const uint d = tid + i * BLOCK_SIZE;
            if (d < p.head_dim) {
                float a = acc[i] * corr;
                for (uint jj = 0; jj < nk; ++jj) a += s_p[jj] * float(v_pool[s_slot[jj] * row + kvo + d]);
                acc[i] = a;
            }
        }
        barrier();  // everyone is done with s_p / s_slot before the next chunk writes them
    }
    const float inv_l = 1.0 / l;
    [[unroll]] for (uint i = 0; i < MAX_DIMS_PER_INVOCATION; ++i) {
        const uint d = tid + i * BLOCK_SIZE;
        if (d < p.head_dim) o[ob + d] = acc[i] * inv_l;
    }
}
