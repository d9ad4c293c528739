#version 450
// Causal attention of q (T, H, Dh) over the paged KV cache of one layer, GQA (H / Hkv query heads per KV head),
// split-K (flash-decoding), pass 1 of 2 (attention_reduce.comp is pass 2):
//   o[t, h] = softmax_j(scale * q[t, h] . k[j]) v[j]  over the key positions j in [lo, hi] of token t's
//   sequence, lo = 0 (global layer, window = 0) or max(0, pos - window + 1) (sliding-window layer), hi = pos,
//   or a later position where the step's visible section says so (an image's soft tokens: last_key).
// The batch comes from the step metadata (hmad/backends/vulkan/stepmeta.py): token t has position
// meta[pos_off + t] and sequence s = meta[seq_off + t] (0xFFFFFFFF: padding row, output zeros); sequence s has
// its block table at meta[info_off + 2s] (absolute index into meta) with meta[info_off + 2s + 1] entries, and
// position j lives in slot table[(j / B) % entries] * B + j % B (a global table covers every position; a local
// one is a ring). The k/v of this step's tokens are already in the pools (kv_write runs first). Pool elements
// are POOL_TYPE (float, or float16_t); math in float32.
//
// One workgroup per (token, KV head, split): the n_splits splits cut [lo, pos] into runs of
// per = max(ceil(len / n_splits), KT) keys (trailing splits may be empty). (At least 64 keys per split was
// tried: slower decode, the tiles of one split run one after the other; docs/tuning.md.) The G = H / Hkv
// query heads of the KV head share each loaded K/V tile. Keys go KT at a time: for the scores, the workgroup is LANES-wide lane
// groups, each taking whole keys (lanes over dims: coalesced loads of one key's row), partial dots reduced in
// shared memory; then the online-softmax update (running max m and sum l per query head) and the output,
// each invocation owning (head, dim) elements e = tid + i * BLOCK_SIZE of the G * Dh outputs.
// Writes per (token, head, split) the partial (m, l, pad, pad, acc[Dh]) to part[part_base(t, h, c)];
// an empty split (or a padding row) writes m = -inf, l = 0 and leaves acc unwritten.
// Host asserts: Dh <= MAX_HEAD_DIM, G <= MAX_GROUP, G * Dh <= MAX_ELEMS_PER_INVOCATION * BLOCK_SIZE,
// BLOCK_SIZE a multiple of LANES.
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_TYPE float
#endif
#define MAX_HEAD_DIM 256
#define MAX_GROUP 8
#define MAX_ELEMS_PER_INVOCATION 8
#define LANES 32
#define KT 16
#define PART_STRIDE (LANES + 1)

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer KP { POOL_TYPE k_pool[]; };
layout(binding = 2) readonly buffer VP { POOL_TYPE v_pool[]; };
layout(binding = 3) readonly buffer Meta { uint meta[]; };
layout(binding = 4) writeonly buffer Part { float part[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;     // H
    uint n_kv_heads;  // Hkv (divides H)
    uint head_dim;    // Dh
    uint q_stride;    // elements between tokens of q
    uint n_splits;
    uint block_size;  // B: positions per KV block
    uint window;      // 0: global; else the sliding window W
    uint pos_off;     // meta sections (word offsets)
    uint seq_off;
    uint info_off;
    float scale;
    uint skip_off;    // 0, or the meta section of per-row flags: rows flagged 1 are attention_prefill's
    uint min_keys;    // attention_decode's; here a split takes at least KT keys (one tile)
    uint vis_off;     // 0, or the meta section of per-row last visible keys (paged_kv.glsl: last_key)
} p;

#include "paged_kv.glsl"
#include "attention_part.glsl"


shared float s_q[MAX_GROUP * MAX_HEAD_DIM];
shared float s_part[KT * MAX_GROUP * PART_STRIDE];
shared float s_s[KT * MAX_GROUP];  // scores, then probabilities
shared uint s_slot[KT];
shared float s_m[MAX_GROUP];
shared float s_corr[MAX_GROUP];

void main() {
    const uint wg = group_index();
    const uint c = wg % p.n_splits;
    const uint rest = wg / p.n_splits;
    const uint kvh = rest % p.n_kv_heads, t = rest / p.n_kv_heads;
    if (t >= p.n_tokens) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x;
    const uint G = p.n_heads / p.n_kv_heads;
    const uint Dh = p.head_dim;
    const uint h0 = kvh * G;

    if (tiled_row(t)) return;  // a tile row: attention_prefill writes it
    uint c0, c1, tab, tab_len;
    split_keys(t, c, KT, c0, c1, tab, tab_len);
    if (c0 >= c1) {  // empty split or padding row: uniform per workgroup
        write_empty_partial(t, h0, c, G, tid);
        return;
    }
    const uint row = p.n_kv_heads * Dh;
    const uint kvo = kvh * Dh;
    const uint B = p.block_size;

    for (uint e = tid; e < G * Dh; e += BLOCK_SIZE) s_q[e] = q[t * p.q_stride + h0 * Dh + e];

    const uint lane = tid % LANES, grp = tid / LANES, n_grp = BLOCK_SIZE / LANES;
    float m_run = NEG_INF, l_run = 0.0;  // meaningful in invocations tid < G (head tid)
    float acc[MAX_ELEMS_PER_INVOCATION];
    [[unroll]] for (uint i = 0; i < MAX_ELEMS_PER_INVOCATION; ++i) acc[i] = 0.0;

    for (uint base = c0; base < c1; base += KT) {
        const uint nk = min(KT, c1 - base);
        if (tid < nk) {
            const uint j = base + tid;
            s_slot[tid] = kv_slot(tab, tab_len, j, B);
        }
        barrier();  // s_slot (and s_q on the first tile) visible; previous tile done with s_s
        // scores: lane group grp takes keys jj = grp, grp + n_grp, ...
        for (uint jj = grp; jj < nk; jj += n_grp) {
            const uint ko = s_slot[jj] * row + kvo;
            float dots[MAX_GROUP];
            [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g) dots[g] = 0.0;
            for (uint d = lane; d < Dh; d += LANES) {
                const float kd = float(k_pool[ko + d]);
                [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g)
                    if (g < G) dots[g] += s_q[g * Dh + d] * kd;
            }
            [[unroll]] for (uint g = 0; g < MAX_GROUP; ++g)
                if (g < G) s_part[(jj * MAX_GROUP + g) * PART_STRIDE + lane] = dots[g];
        }
        barrier();
        if (tid < KT * G) {
            const uint jj = tid / G, g = tid % G;
            float s = NEG_INF;
            if (jj < nk) {
                s = 0.0;
                for (uint l = 0; l < LANES; ++l) s += s_part[(jj * MAX_GROUP + g) * PART_STRIDE + l];
                s *= p.scale;
            }
            s_s[jj * MAX_GROUP + g] = s;
        }
        barrier();
        if (tid < G) {
            float mt = NEG_INF;
            for (uint jj = 0; jj < nk; ++jj) mt = max(mt, s_s[jj * MAX_GROUP + tid]);
            const float m_new = max(m_run, mt);  // finite: the tile has at least one live key
            const float corr = exp(m_run - m_new);
            s_m[tid] = m_new;
            s_corr[tid] = corr;
            m_run = m_new;
        }
        barrier();
        if (tid < KT * G) {
            const uint jj = tid / G, g = tid % G;
            s_s[jj * MAX_GROUP + g] = jj < nk ? exp(s_s[jj * MAX_GROUP + g] - s_m[g]) : 0.0;
        }
        barrier();
        if (tid < G) {
            float sum = 0.0;
            for (uint jj = 0; jj < nk; ++jj) sum += s_s[jj * MAX_GROUP + tid];
            l_run = l_run * s_corr[tid] + sum;
        }
        [[unroll]] for (uint i = 0; i < MAX_ELEMS_PER_INVOCATION; ++i) {
            const uint e = tid + i * BLOCK_SIZE;
            if (e < G * Dh) {
                const uint g = e / Dh, d = e % Dh;
                float a = acc[i] * s_corr[g];
                for (uint jj = 0; jj < nk; ++jj)
                    a += s_s[jj * MAX_GROUP + g] * float(v_pool[s_slot[jj] * row + kvo + d]);
                acc[i] = a;
            }
        }
        barrier();  // everyone done with s_s / s_slot / s_corr before the next tile
    }
    [[unroll]] for (uint i = 0; i < MAX_ELEMS_PER_INVOCATION; ++i) {
        const uint e = tid + i * BLOCK_SIZE;
        if (e < G * Dh) {
            const uint g = e / Dh, d = e % Dh;
            part[part_base(t, h0 + g, c) + PART_ACC + d] = acc[i];
        }
    }
    if (tid < G) {
        const uint pb = part_base(t, h0 + tid, c);
        part[pb] = m_run;
        part[pb + 1] = l_run;
    }
}
