#version 450
// logits[row, token] += delta for each additive adjustment of a step (logit_bias, presence and frequency
// penalties: engine/sampling.py, step 0; StepBatch.bias), before the argmax, top-k or draw tails read the
// rows. The entries come in the step parity's host-visible buffer (backends/vulkan/bias.py): word 0 their
// count n, words 1-3 zero, then n (row, token, delta bits) triples, each (row, token) at most once, so the
// adds never race. Entries past the graph's rows or the vocabulary are skipped. One float32 add, as the
// host's: the same adjusted logits on both paths.
#include "common.glsl"

layout(binding = 0) buffer L { float logits[]; };       // (n_rows, row_stride)
layout(binding = 1) readonly buffer B { uint bias[]; };  // n, 0, 0, 0, then (row, token, delta) x n

layout(push_constant) uniform Push {
    uint n_rows;      // logit rows of the graph
    uint vocab;
    uint row_stride;  // elements between rows of logits
    uint capacity;    // entries the buffer holds
} p;

void main() {
    const uint n = min(bias[0], p.capacity);
    for (uint i = global_index(); i < n; i += grid_size()) {
        const uint row = bias[4u + 3u * i], tok = bias[5u + 3u * i];
        if (row < p.n_rows && tok < p.vocab) {
            const uint at = row * p.row_stride + tok;
            logits[at] = logits[at] + uintBitsToFloat(bias[6u + 3u * i]);
        }
    }
}
