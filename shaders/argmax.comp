#version 450
// ids[r] = argmax_j logits[r, j] over (S, V) (greedy sampling; ties -> the lowest j; NaN never wins, a row of
// only NaN gives 0xFFFFFFFF). One workgroup per row: each invocation scans a strided slice keeping its best
// (value, index), then a shared-memory tree merges them. Fine for V = 262144 (1 MiB a row, read once).
#include "common.glsl"

layout(binding = 0) readonly buffer L { float logits[]; };
layout(binding = 1) writeonly buffer O { uint ids[]; };

layout(push_constant) uniform Push {
    uint n_rows;
    uint n_cols;      // V
    uint row_stride;  // elements between rows of logits
} p;

shared float s_val[BLOCK_SIZE];
shared uint s_idx[BLOCK_SIZE];

const uint NONE = 0xFFFFFFFFu;

// whether (v, i) beats (bv, bi): larger, or equal with a lower index; NaN never beats anything
bool better(float v, uint i, float bv, uint bi) {
    return v > bv || (v == bv && i < bi) || (bi == NONE && i != NONE && !isnan(v));
}

void main() {
    const uint row = group_index();
    if (row >= p.n_rows) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint ro = row * p.row_stride;
    float bv = uintBitsToFloat(0xFF800000u);  // -inf
    uint bi = NONE;
    for (uint c = tid; c < p.n_cols; c += BLOCK_SIZE) {
        const float v = logits[ro + c];
        if (better(v, c, bv, bi)) {
            bv = v;
            bi = c;
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
    if (tid == 0) ids[row] = s_idx[0];
}
