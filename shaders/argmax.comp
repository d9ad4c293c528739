#version 450
// ids[r] = argmax_j logits[r, j] over (S, V) (greedy sampling; ties -> the lowest j; NaN never wins, a row of
// only NaN gives 0xFFFFFFFF). A workgroup takes p.chunk columns of a row: each invocation scans a strided slice
// keeping its best (value, index), then a shared-memory tree merges them. With one chunk a row (argmax_f32)
// that is the answer; a long row takes two stages (backends/vulkan/backend.py, _argmax_tail), as one
// workgroup reading a whole row is bound by its loads' latency (docs/tuning.md):
// - argmax_chunks_f32 (CHUNKS): each (row, chunk)'s best index and value into (S, n_chunks);
// - argmax_merge_f32 (MERGE): each row's best of its chunks' (values, indices).
// "Better" (larger, or equal with a lower index) is a total order on the non-NaN pairs, so any merge order
// gives the same pick.
#include "common.glsl"

layout(binding = 0) readonly buffer L { float logits[]; };  // (S, row_stride): logits, or chunk maxima
layout(binding = 1) writeonly buffer O { uint ids[]; };     // (S, n_chunks) with CHUNKS, else (S,)
#ifdef CHUNKS
layout(binding = 2) writeonly buffer V { float vals[]; };   // (S, n_chunks): each chunk's best value
#endif
#ifdef MERGE
layout(binding = 2) readonly buffer C { uint cand_ids[]; };  // (S, row_stride): each chunk's best index
#endif

layout(push_constant) uniform Push {
    uint n_rows;
    uint n_cols;      // V, or the chunks of the first stage
    uint row_stride;  // elements between rows of the input
    uint chunk;       // columns a workgroup (n_cols or more: one a row)
} p;

shared float s_val[BLOCK_SIZE];
shared uint s_idx[BLOCK_SIZE];

const uint NONE = 0xFFFFFFFFu;

// whether (v, i) beats (bv, bi): larger, or equal with a lower index; NaN never beats anything
bool better(float v, uint i, float bv, uint bi) {
    return v > bv || (v == bv && i < bi) || (bi == NONE && i != NONE && !isnan(v));
}

void main() {
    const uint n_chunks = (p.n_cols + p.chunk - 1u) / p.chunk;
    const uint g = group_index();
    if (g >= p.n_rows * n_chunks) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint ro = (g / n_chunks) * p.row_stride;
    const uint c_lo = (g % n_chunks) * p.chunk, c_hi = min(c_lo + p.chunk, p.n_cols);
    float bv = uintBitsToFloat(0xFF800000u);  // -inf
    uint bi = NONE;
    for (uint c = c_lo + tid; c < c_hi; c += BLOCK_SIZE) {
        const float v = logits[ro + c];
#ifdef MERGE
        const uint i = cand_ids[ro + c];
#else
        const uint i = c;
#endif
        if (better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    s_val[tid] = bv;
    s_idx[tid] = bi;
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2; s > 0; s >>= 1) {
        if (tid < s && better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
            s_val[tid] = s_val[tid + s];
            s_idx[tid] = s_idx[tid + s];
        }
        barrier();
    }
    if (tid == 0) {
        ids[g] = s_idx[0];
#ifdef CHUNKS
        vals[g] = s_val[0];
#endif
    }
}
