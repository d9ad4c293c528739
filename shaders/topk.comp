#version 450
// The k best logits of each row of (S, V): ids[r, i] and vals[r, i] for i < k, ordered by value (largest
// first), equal values by id (lowest first) — the order hmad/engine/sampling.py's top-k defines, so the
// host samples from these k candidates exactly as from the whole row. NaN ranks as -inf. k <= KMAX.
//
// Two stages where a row is long (backends/vulkan/backend.py, _record_topk):
// - topk_f32: one workgroup per (row, chunk of p.chunk columns) writes its chunk's best min(k, chunk
//   length) in the order above to (S, n_chunks, k), the rest of its k slots SENTINEL ids; with one chunk a
//   row (chunk >= V) that is the answer itself;
// - topk_merge_f32 (FROM_CANDIDATES): one workgroup per row selects the k best of its n_chunks * k
//   candidates, reading ids with the values. A candidate of the row's k best is among its chunk's k best,
//   so the two stages keep the same k; and the candidates equal to the k-th value come, chunk after chunk,
//   each chunk's in id order, so "lowest position" below is "lowest id" there too.
//
// Each workgroup: radix select on a monotone 32-bit key of each value, 8 bits a round from the top (4
// passes over its columns, a 256-bin shared histogram each) finds the k-th largest key K* and how many of the
// keys equal to K* are taken (need); a last pass gives each invocation a contiguous part of the columns, so
// the keys equal to K* are numbered in position order (exclusive scan of per-part counts) and the lowest
// `need` of them kept, with every key above K*; the k candidates are then ranked in shared memory and
// written sorted.
#include "common.glsl"

#define KMAX 256u
#define SENTINEL 0xFFFFFFFFu  // an empty candidate slot: below every value (key 0)

layout(binding = 0) readonly buffer L { float logits[]; };  // (S, row_stride): logits, or candidates' values
layout(binding = 1) writeonly buffer I { uint ids[]; };     // (S, n_chunks, k)
layout(binding = 2) writeonly buffer F { float vals[]; };   // (S, n_chunks, k)
#ifdef FROM_CANDIDATES
layout(binding = 3) readonly buffer C { uint cand_ids[]; };  // (S, row_stride): the candidates' ids
#endif

layout(push_constant) uniform Push {
    uint n_rows;
    uint n_cols;      // V, or n_chunks * k candidates
    uint row_stride;  // elements between rows of the input
    uint k;           // candidates per row, 1 <= k <= min(KMAX, n_cols)
    uint chunk;       // columns a workgroup; n_chunks = ceil(n_cols / chunk)
} p;

shared uint s_hist[256];
shared uint s_prefix, s_need, s_above;
shared uint s_eq[BLOCK_SIZE];   // per-part counts of keys == K*, then their exclusive prefix sums
shared uint c_pos[KMAX];
shared uint c_key[KMAX];

// larger value <=> larger key; NaN -> the key of -inf (0x007FFFFF)
uint key_of(float v) {
    const uint u = floatBitsToUint(v);
    return isnan(v) ? 0x007FFFFFu : ((u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u));
}

#ifdef FROM_CANDIDATES
uint key_at(uint i) { return cand_ids[i] == SENTINEL ? 0u : key_of(logits[i]); }
uint id_at(uint i, uint ro) { return cand_ids[i]; }
#else
uint key_at(uint i) { return key_of(logits[i]); }
uint id_at(uint i, uint ro) { return i - ro; }
#endif

void main() {
    const uint n_chunks = (p.n_cols + p.chunk - 1u) / p.chunk;
    const uint g = group_index();
    if (g >= p.n_rows * n_chunks) return;
    const uint row = g / n_chunks;
    const uint tid = gl_LocalInvocationID.x;
    const uint ro = row * p.row_stride;
    const uint c_lo = ro + (g % n_chunks) * p.chunk;           // this workgroup's columns [c_lo, c_hi)
    const uint c_hi = ro + min((g % n_chunks + 1u) * p.chunk, p.n_cols);
    const uint kk = min(p.k, c_hi - c_lo);

    uint prefix = 0u, mask = 0u, need = kk;
    for (uint shift = 24u; ; shift -= 8u) {
        s_hist[tid % 256u] = 0u;  // BLOCK_SIZE >= 256
        barrier();
        for (uint c = c_lo + tid; c < c_hi; c += BLOCK_SIZE) {
            const uint key = key_at(c);
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
    // prefix = K*; keys above it: kk - need of them; keys equal: take the `need` lowest positions
    const uint part = (c_hi - c_lo + BLOCK_SIZE - 1u) / BLOCK_SIZE;
    const uint c0 = min(c_lo + tid * part, c_hi), c1 = min(c0 + part, c_hi);
    uint n_eq = 0u;
    for (uint c = c0; c < c1; ++c) n_eq += key_at(c) == prefix ? 1u : 0u;
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
    const uint n_above = kk - need;
    for (uint c = c0; c < c1; ++c) {
        const uint key = key_at(c);
        if (key > prefix) {
            const uint slot = atomicAdd(s_above, 1u);
            c_pos[slot] = c;
            c_key[slot] = key;
        } else if (key == prefix) {
            if (eq_rank < need) {
                c_pos[n_above + eq_rank] = c;
                c_key[n_above + eq_rank] = key;
            }
            ++eq_rank;
        }
    }
    barrier();
    const uint dst = g * p.k;  // (row, chunk)'s k slots; with one chunk a row, the row's
    for (uint i = tid; i < p.k; i += BLOCK_SIZE) {
        if (i >= kk) {
            ids[dst + i] = SENTINEL;
            vals[dst + i] = uintBitsToFloat(0xFF800000u);  // -inf
            continue;
        }
        const uint ki = c_key[i], ci = c_pos[i];
        uint rank = 0u;
        for (uint j = 0u; j < kk; ++j) {
            const uint kj = c_key[j];
            rank += (kj > ki || (kj == ki && c_pos[j] < ci)) ? 1u : 0u;
        }
        ids[dst + rank] = id_at(ci, ro);
        vals[dst + rank] = logits[ci];
    }
}
