#version 450
// out[r] = logits[r, t]: each logit row's logit of one given token t (a prompt-logprobs request's next prompt
// token: its logprob is that value minus the row's log-sum-exp, row_lse.comp), t from the step metadata's
// targets section (backends/vulkan/stepmeta.py: word 1 + t, 0 for a row with none). The top-k tail records
// it beside topk.comp and row_lse.comp, after the step's logit adjustments (backends/vulkan/tails.py), so
// the three see the same row. A row with no target, or one outside the vocabulary, gets NaN (the host reads
// only the rows it gave a target: engine/tokens.py).
#include "common.glsl"

layout(binding = 0) readonly buffer M { uint meta[]; };     // the step metadata (device-local copy)
layout(binding = 1) readonly buffer L { float logits[]; };  // (n_rows, row_stride)
layout(binding = 2) writeonly buffer O { float picked[]; }; // (n_rows,)

layout(push_constant) uniform Push {
    uint n_rows;       // logit rows of the graph
    uint n_cols;       // V
    uint row_stride;   // elements between rows of logits
    uint targets_off;  // word offset of the targets section (n_rows words at least)
} p;

void main() {
    for (uint r = global_index(); r < p.n_rows; r += grid_size()) {
        const uint w = meta[p.targets_off + r];
        picked[r] = (w != 0u && w - 1u < p.n_cols) ? logits[r * p.row_stride + (w - 1u)]
                                                   : uintBitsToFloat(0x7FC00000u);
    }
}
