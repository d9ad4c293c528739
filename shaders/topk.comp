#version 450
// The k best logits of each row of (S, V): ids[r, i] and vals[r, i] for i < k, ordered by value (largest
// first), equal values by id (lowest first) — the order hmad/engine/sampling.py's top-k defines, so the
// host samples from these k candidates exactly as from the whole row. NaN ranks as -inf. k <= KMAX.
//
// One workgroup per row. Radix select on a monotone 32-bit key of each value, 8 bits a round from the top
// (4 passes over the row, a 256-bin shared histogram each) finds the k-th largest key K* and how many of the
// keys equal to K* are taken (need); a last pass gives each invocation a contiguous chunk of the row, so the
// keys equal to K* are numbered in id order (exclusive scan of per-chunk counts) and the lowest-id `need` of
// them kept, with every key above K*; the k candidates are then ranked in shared memory and written sorted.
#include "common.glsl"

#define KMAX 256u

layout(binding = 0) readonly buffer L { float logits[]; };
layout(binding = 1) writeonly buffer I { uint ids[]; };     // (S, k)
layout(binding = 2) writeonly buffer F { float vals[]; };   // (S, k)

layout(push_constant) uniform Push {
    uint n_rows;
    uint n_cols;      // V
    uint row_stride;  // elements between rows of logits
    uint k;           // candidates per row, 1 <= k <= min(KMAX, V)
} p;

shared uint s_hist[256];
shared uint s_prefix, s_need, s_above;
shared uint s_eq[BLOCK_SIZE];   // per-chunk counts of keys == K*, then their exclusive prefix sums
shared uint c_id[KMAX];
shared uint c_key[KMAX];

// larger value <=> larger key; NaN -> the key of -inf (0x007FFFFF)
uint key_of(float v) {
    const uint u = floatBitsToUint(v);
    return isnan(v) ? 0x007FFFFFu : ((u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u));
}

void main() {
    const uint row = group_index();
    if (row >= p.n_rows) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint ro = row * p.row_stride;

    uint prefix = 0u, mask = 0u, need = p.k;
    for (uint shift = 24u; ; shift -= 8u) {
        s_hist[tid % 256u] = 0u;  // BLOCK_SIZE >= 256
        barrier();
        for (uint c = tid; c < p.n_cols; c += BLOCK_SIZE) {
            const uint key = key_of(logits[ro + c]);
            if ((key & mask) == prefix) atomicAdd(s_hist[(key >> shift) & 255u], 1u);
        }
        barrier();
        if (tid == 0u) {
            uint cum = 0u, d = 255u;
            for (;; --d) {  // the digit where the count from the top reaches need
                if (cum + s_hist[d] >= need || d == 0u) break;
                cum += s_hist[d];
            }
            s_prefix = prefix | (d << shift);
            s_need = need - cum;
        }
        barrier();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
        if (shift == 0u) break;
    }
    // prefix = K*; keys above it: k - need of them; keys equal: take the `need` lowest ids
    const uint chunk = (p.n_cols + BLOCK_SIZE - 1u) / BLOCK_SIZE;
    const uint c0 = min(tid * chunk, p.n_cols), c1 = min(c0 + chunk, p.n_cols);
    uint n_eq = 0u;
    for (uint c = c0; c < c1; ++c) n_eq += key_of(logits[ro + c]) == prefix ? 1u : 0u;
    s_eq[tid] = n_eq;
    if (tid == 0u) s_above = 0u;
    barrier();
    if (tid == 0u) {
        uint run = 0u;
        for (uint i = 0u; i < BLOCK_SIZE; ++i) {
            const uint v = s_eq[i];
            s_eq[i] = run;
            run += v;
        }
    }
    barrier();
    uint eq_rank = s_eq[tid];
    const uint n_above = p.k - need;
    for (uint c = c0; c < c1; ++c) {
        const uint key = key_of(logits[ro + c]);
        if (key > prefix) {
            const uint slot = atomicAdd(s_above, 1u);
            c_id[slot] = c;
            c_key[slot] = key;
        } else if (key == prefix) {
            if (eq_rank < need) {
                c_id[n_above + eq_rank] = c;
                c_key[n_above + eq_rank] = key;
            }
            ++eq_rank;
        }
    }
    barrier();
    for (uint i = tid; i < p.k; i += BLOCK_SIZE) {
        const uint ki = c_key[i], ii = c_id[i];
        uint rank = 0u;
        for (uint j = 0u; j < p.k; ++j) {
            const uint kj = c_key[j];
            rank += (kj > ki || (kj == ki && c_id[j] < ii)) ? 1u : 0u;
        }
        ids[row * p.k + rank] = ii;
        vals[row * p.k + rank] = logits[ro + ii];
    }
}
