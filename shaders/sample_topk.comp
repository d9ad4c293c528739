#version 450
// A pipelined step's sampled token of each logit row, on the device, from that row's top-k candidates
// (topk.comp: k candidates a row, largest first, equal values lowest id first) and the row's sampling in
// the step metadata (stepmeta.py "sample": temperature, top_k, top_p, min_p, the draw's uniform u). It
// follows hmad/engine/sampling.py step by step so the host, drawing from the same candidates with the same
// u, picks the same token but at rounding edges (float32 sums here, float64 there; the GPU's exp and log2):
//   temperature 0: the first candidate (the argmax);
//   else the first min(top_k, k) candidates, in id order; weights w = exp((v - top) / T);
//   top_p < 1: buckets of 1/8 octave, key = min(trunc(-8 log2 w), 1208); b = the first key whose
//     cumulative mass (keys <= b) reaches top_p * sum(w); keep every key < b in id order, then the members
//     of bucket b heaviest first until their mass covers what is still needed (sampling._nucleus);
//   min_p > 0: keep w >= min_p, in that order;
//   draw: the first kept entry whose running sum exceeds u * sum (a zero weight is never taken).
// The host checks every token against its own draw (engine/scheduler.py, "Pipelining").
// One workgroup per row, k <= BLOCK_SIZE <= KMAX invocations: each puts its candidate at its rank by id and
// computes its weight, bucket and cumulative bucket mass; invocation 0 then walks the <= k entries.
#include "common.glsl"

#define KMAX 256u
#define LAST_BUCKET 1208u  // sampling._NUCLEUS_LAST_BUCKET: 8 * 151

layout(binding = 0) readonly buffer M { uint meta[]; };
layout(binding = 1) readonly buffer CI { uint cand_ids[]; };  // (S, k)
layout(binding = 2) readonly buffer CV { float cand_vals[]; }; // (S, k)
layout(binding = 3) writeonly buffer O { uint ids[]; };       // (S,)

layout(push_constant) uniform Push {
    uint n_rows;      // rows of the candidates buffers (the step's rows: header word 3)
    uint k;           // candidates per row
    uint sample_off;  // word offset of the sample section (5 words a row)
} p;

shared uint s_id[KMAX];    // the top-k candidates in id order
shared float s_w[KMAX];    // their weights
shared uint s_key[KMAX];   // their buckets
shared float s_cum[KMAX];  // the mass of every entry with a key <= theirs
shared uint s_keep[KMAX];  // positions kept, in draw order

float row_mass(uint n, uint upto_key, bool inclusive) {
    float m = 0.0;
    for (uint j = 0u; j < n; ++j) {
        if (s_key[j] < upto_key || (inclusive && s_key[j] == upto_key)) m += s_w[j];
    }
    return m;
}

// top-p over the n entries (sampling._nucleus): fills s_keep, returns how many
uint nucleus(uint n, float top_p) {
    float total = 0.0;
    for (uint j = 0u; j < n; ++j) total += s_w[j];
    const float target = top_p * total;
    uint b = LAST_BUCKET;
    for (uint j = 0u; j < n; ++j) {
        if (s_cum[j] >= target) b = min(b, s_key[j]);
    }
    const float need = target - row_mass(n, b, false);
    uint nk = 0u;
    for (uint j = 0u; j < n; ++j) {
        if (s_key[j] < b) s_keep[nk++] = j;
    }
    // bucket b heaviest first (equal weights: id order), at least one, until the running mass reaches need
    float run = 0.0;
    uint taken = 0u;
    while (taken == 0u || run < need) {
        uint best = KMAX;
        for (uint j = 0u; j < n; ++j) {
            if (s_key[j] != b || s_w[j] < 0.0) continue;  // taken ones are marked with -1
            if (best == KMAX || s_w[j] > s_w[best]) best = j;
        }
        if (best == KMAX) break;  // rounding: the whole bucket
        run += s_w[best];
        s_keep[nk++] = best;
        s_cum[best] = s_w[best];  // keep the weight; mark it taken
        s_w[best] = -1.0;
        ++taken;
    }
    for (uint t = nk - taken; t < nk; ++t) s_w[s_keep[t]] = s_cum[s_keep[t]];
    return nk;
}

void main() {
    const uint row = group_index();
    if (row >= min(p.n_rows, meta[3])) return;
    const uint base = p.sample_off + 5u * row;
    const float temperature = uintBitsToFloat(meta[base]);
    const uint top_k = meta[base + 1u];
    const float top_p = uintBitsToFloat(meta[base + 2u]);
    const float min_p = uintBitsToFloat(meta[base + 3u]);
    const float u01 = uintBitsToFloat(meta[base + 4u]);
    const uint c0 = row * p.k;
    const uint i = gl_LocalInvocationID.x;
    if (temperature == 0.0 || top_k == 0u) {
        if (i == 0u) ids[row] = cand_ids[c0];
        return;
    }
    const uint n = min(min(top_k, p.k), BLOCK_SIZE);
    const float top = cand_vals[c0];
    uint r = 0u;
    if (i < n) {
        const uint id = cand_ids[c0 + i];
        for (uint j = 0u; j < n; ++j) r += uint(cand_ids[c0 + j] < id);
        const float w = exp((cand_vals[c0 + i] - top) / temperature);
        s_id[r] = id;
        s_w[r] = w;
        s_key[r] = uint(min(log2(w) * -8.0, float(LAST_BUCKET)));  // w = 0: +inf -> the last bucket
    }
    barrier();
    if (i < n) s_cum[r] = row_mass(n, s_key[r], true);
    barrier();
    if (i != 0u) return;
    uint nk = n;
    if (top_p < 1.0) {
        nk = nucleus(n, top_p);
    } else {
        for (uint j = 0u; j < n; ++j) s_keep[j] = j;
    }
    if (min_p > 0.0) {
        uint m = 0u;
        for (uint t = 0u; t < nk; ++t) {
            if (s_w[s_keep[t]] >= min_p) s_keep[m++] = s_keep[t];
        }
        nk = m;
    }
    float total = 0.0;
    for (uint t = 0u; t < nk; ++t) total += s_w[s_keep[t]];
    const float u = u01 * total;
    float run = 0.0;
    uint pick = KMAX, last = KMAX;
    for (uint t = 0u; t < nk && pick == KMAX; ++t) {
        const float w = s_w[s_keep[t]];
        run += w;
        if (w > 0.0) last = t;
        if (run > u && w > 0.0) pick = t;
    }
    if (pick == KMAX) pick = last;
    ids[row] = pick == KMAX ? cand_ids[c0] : s_id[s_keep[pick]];
}
