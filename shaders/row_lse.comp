#version 450
// lse[r] = log(sum_j exp(logits[r, j])) over (S, V), max-subtracted: m + log(sum(exp(x - m))), NaN counted as
// -inf (engine/logprobs.py's semantics; a token's logprob is its value minus its row's lse). A workgroup
// takes p.chunk columns of a row: each invocation keeps a running (max, sum) pair over a strided slice (online
// softmax: the sum rescaled when the max grows), then a shared-memory tree merges the pairs. With one chunk a
// row (row_lse_f32) that gives the answer; a long row takes two stages (backends/vulkan/tails.py,
// Readback._record_topk), as argmax.comp does, one workgroup reading a whole row being bound by its loads'
// latency:
// - row_lse_chunks_f32 (CHUNKS): each (row, chunk)'s (max, sum) into (S, n_chunks) each;
// - row_lse_merge_f32 (MERGE): each row's chunks' pairs merged, then its lse.
// A row with no finite maximum (all -inf or NaN) gives -inf; one with a +inf gives +inf or NaN: the host
// fails that request alone.
#include "common.glsl"

layout(binding = 0) readonly buffer L { float logits[]; };  // (S, row_stride): logits, or chunk maxima
#ifdef CHUNKS
layout(binding = 1) writeonly buffer M { float maxes[]; };  // (S, n_chunks): each chunk's max
layout(binding = 2) writeonly buffer U { float sums[]; };   // (S, n_chunks): its sum of exp(x - max)
#else
layout(binding = 1) writeonly buffer O { float lse[]; };    // (S,)
#endif
#ifdef MERGE
layout(binding = 2) readonly buffer C { float chunk_sums[]; };  // (S, row_stride): each chunk's sum
#endif

layout(push_constant) uniform Push {
    uint n_rows;
    uint n_cols;      // V, or the chunks of the first stage
    uint row_stride;  // elements between rows of the input
    uint chunk;       // columns a workgroup (n_cols or more: one a row)
} p;

shared float s_max[BLOCK_SIZE];
shared float s_sum[BLOCK_SIZE];

#define NEG_INF uintBitsToFloat(0xFF800000u)

// (m, s) with the part (m2, s2) added: the larger max, each sum rescaled to it. A part at -inf or NaN
// (a masked logit, an empty chunk) adds nothing.
void add(inout float m, inout float s, float m2, float s2) {
    if (!(m2 > NEG_INF)) return;
    if (m2 > m) {
        s = s * exp(m - m2) + s2;
        m = m2;
    } else {
        s += s2 * exp(m2 - m);
    }
}

void main() {
    const uint n_chunks = (p.n_cols + p.chunk - 1u) / p.chunk;
    const uint g = group_index();
    if (g >= p.n_rows * n_chunks) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint ro = (g / n_chunks) * p.row_stride;
    const uint c_lo = (g % n_chunks) * p.chunk, c_hi = min(c_lo + p.chunk, p.n_cols);
    float m = NEG_INF, s = 0.0;
    for (uint c = c_lo + tid; c < c_hi; c += BLOCK_SIZE) {
#ifdef MERGE
        add(m, s, logits[ro + c], chunk_sums[ro + c]);
#else
        add(m, s, logits[ro + c], 1.0);
#endif
    }
    s_max[tid] = m;
    s_sum[tid] = s;
    barrier();
    [[unroll]] for (uint h = BLOCK_SIZE / 2; h > 0; h >>= 1) {
        if (tid < h) {
            float mm = s_max[tid], ss = s_sum[tid];
            add(mm, ss, s_max[tid + h], s_sum[tid + h]);
            s_max[tid] = mm;
            s_sum[tid] = ss;
        }
        barrier();
    }
    if (tid == 0) {
#ifdef CHUNKS
        maxes[g] = s_max[0];
        sums[g] = s_sum[0];
#else
        lse[g] = s_max[0] == NEG_INF ? NEG_INF : s_max[0] + log(s_sum[0]);
#endif
    }
}
